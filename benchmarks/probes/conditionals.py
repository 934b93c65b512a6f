r"""Probe: where the training step's conditionals run, and what they cost in wall time.

    python -m benchmarks.probes.conditionals [--mode=fwd_bwd|fwd] [--spec=paper_16k] [--iters=30]

The mosaic_gpu forward + backward has one conditional per direction (a `lax.switch` over the
dense-tail buckets and the dense fallback); the inference forward has none. XLA runs a
conditional inside a CUDA-graph command buffer only when its command type CONDITIONAL is enabled
(``--xla_gpu_enable_command_buffer``); otherwise the branch index is copied to the host and
the branch launched from there: a device -> host synchronization per conditional per step,
which the per-kernel (CUPTI) times do not show. This prints, for the step as compiled under
the current XLA_FLAGS, how many conditionals sit in command-buffer computations and how many
outside, then the step's synchronized and pipelined wall time against XLA dense's (which has
no conditionals), with the device time (CUPTI) and kernel count. ``--mode=fwd`` does the same
for the inference forward (it compiles without a conditional). Run it once per XLA_FLAGS
setting (one process each).
"""

from __future__ import annotations

import os
import re

from absl import app
from absl import flags
import jax
from jax import lax
import jax.numpy as jnp

from benchmarks.common import specs as specs_lib
from benchmarks.common import timing
from pallas_kernels import ffn_mgpu
from pallas_kernels import ffn_train_mgpu
from pallas_kernels import reference

_SPEC = flags.DEFINE_list("spec", ["paper_16k"], "benchmarks.common.specs names.")
_BREAKDOWN = flags.DEFINE_bool("breakdown", False, "print every kernel's device time")
_MODE = flags.DEFINE_enum("mode", "fwd_bwd", ["fwd", "fwd_bwd"],
                          "fwd: the inference forward")
_ITERS = flags.DEFINE_integer("iters", 30, "Timed calls per measurement.")


def conditional_placement(hlo_text: str) -> dict:
  """{"in_command_buffer": n, "outside": n} over the `conditional` ops of compiled HLO text.

  A conditional counts as inside when the computation holding it is a command-buffer
  computation or is called (transitively) only from one."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      current = head.group(1)
      comps[current] = []
    elif current is not None:
      comps[current].append(line)
  callers = {name: set() for name in comps}
  for name, body in comps.items():
    for line in body:
      for callee in re.findall(r"(?:to_apply|calls|branch_computations|body|condition)="
                               r"\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)\}?", line):
        for c in re.split(r",\s*%?", callee):
          if c in callers:
            callers[c].add(name)

  def in_cmd_buffer(name, seen=()):
    if "command_buffer" in name:
      return True
    if not callers.get(name) or name in seen:
      return False
    return all(in_cmd_buffer(c, seen + (name,)) for c in callers[name])

  out = {"in_command_buffer": 0, "outside": 0}
  for name, body in comps.items():
    n = sum(1 for line in body if " conditional(" in line)
    if n:
      out["in_command_buffer" if in_cmd_buffer(name) else "outside"] += n
  return out


class _StaticSwitch:
  """Stands in for `jax.lax` in a kernel module while tracing: `switch` runs the branch that
  `pick(number of branches)` names, unconditionally (no conditional in the program)."""

  def __init__(self, pick):
    self._pick = pick

  def __getattr__(self, name):
    return getattr(lax, name)

  def switch(self, index, branches, *operands):
    del index
    return branches[self._pick(len(branches))](*operands)


def _forward_variants(k: int) -> dict:
  """y-only forward programs: XLA dense and the shipped forward (which has no conditional: its
  dense path for overflowing rows reads the row count on the device)."""
  cfg = ffn_mgpu.ForwardConfig(hot_features=k)
  return {"dense": jax.jit(lambda *a: reference.dense_ffn_hidden(*a)[0]),
          "shipped": jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a, config=cfg)[0])}


def _report(name, f, args) -> dict:
  text = f.lower(*args).compile().as_text()
  r = {"conditionals": conditional_placement(text),
       "wall_ms": timing.wall_ms(f, *args, iters=_ITERS.value),
       "pipelined_ms": timing.pipelined_ms(f, *args, iters=_ITERS.value),
       "device_ms": timing.device_ms(f, *args)}
  table = timing.kernel_breakdown(f, *args)
  r["kernels"] = len(table) if table else None
  if _BREAKDOWN.value and table:
    for kname, t in table:
      print(f"      {t:8.4f} ms  {kname[:100]}")
  dev = r["device_ms"] if r["device_ms"] is not None else float("nan")
  print(f"  {name:15s} conditionals {r['conditionals']}; synchronized {r['wall_ms']:.3f} ms, "
        f"pipelined {r['pipelined_ms']:.3f} ms/call, device {dev:.3f} ms in "
        f"{r['kernels']} kernels", flush=True)
  return r


def main(argv):
  del argv
  print("device:", jax.devices()[0].device_kind, "| XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""),
        flush=True)
  for name in _SPEC.value:
    spec = specs_lib.get(name)
    if _MODE.value == "fwd":
      args, k = specs_lib.calibrated_inputs(spec)
      print(f"{name} forward, hot_features={k}", flush=True)
      for variant, f in _forward_variants(k).items():
        _report(variant, f, args)
      continue
    (x, wg, wu, wd), k = specs_lib.calibrated_inputs(spec)
    ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    print(f"{name} forward + backward, hot_features={k}", flush=True)
    for variant, impl, pick in (("dense", "dense", None), ("mosaic_gpu", "mosaic_gpu", None),
                                ("smallest_tail", "mosaic_gpu", lambda n: 0)):
      loss = specs_lib.loss_fn(impl, spec, False, k)

      def traced(*args, loss=loss, pick=pick):
        saved = ffn_train_mgpu.lax
        ffn_train_mgpu.lax = _StaticSwitch(pick) if pick else lax
        try:
          return jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
        finally:
          ffn_train_mgpu.lax = saved
      _report(variant, jax.jit(traced), (x, wg, wu, wd, ct))

if __name__ == "__main__":
  app.run(main)
