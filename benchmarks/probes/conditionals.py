r"""Probe: where the training step's conditionals run, and what they cost in wall time.

    python -m benchmarks.probes.conditionals [--spec=paper_16k] [--iters=30]

The mosaic_gpu forward + backward has one conditional per direction (a `lax.switch` over the
dense-tail buckets and the dense fallback). XLA runs a conditional inside a CUDA-graph
command buffer only when its command type CONDITIONAL is enabled
(``--xla_gpu_enable_command_buffer``); otherwise the branch index is copied to the host and
the branch launched from there: a device -> host synchronization per conditional per step,
which the per-kernel (CUPTI) times do not show. This prints, for the step as compiled under
the current XLA_FLAGS, how many conditionals sit in command-buffer computations and how many
outside, then the step's synchronized and pipelined wall time against XLA dense's (which has
no conditionals). Run it once per XLA_FLAGS setting (one process each).
"""

from __future__ import annotations

import os
import re

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks import kernels
from benchmarks import specs as specs_lib
from benchmarks import timing

_SPEC = flags.DEFINE_string("spec", "paper_16k", "benchmarks.specs name.")
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


def main(argv):
  del argv
  spec = specs_lib.get(_SPEC.value)
  x, wg, wu, wd = spec.inputs()
  ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
  print("device:", jax.devices()[0].device_kind, "| XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""),
        flush=True)
  for impl in ("dense", "mosaic_gpu"):
    f = jax.jit(jax.grad(kernels.loss_fn(impl, spec, ct), argnums=(0, 1, 2, 3)))
    text = f.lower(x, wg, wu, wd).compile().as_text()
    place = conditional_placement(text)
    wall = timing.wall_ms(f, x, wg, wu, wd, iters=_ITERS.value)
    piped = timing.pipelined_ms(f, x, wg, wu, wd, iters=_ITERS.value)
    print(f"  {impl:10s} conditionals {place}; synchronized {wall:.3f} ms, "
          f"pipelined {piped:.3f} ms/call", flush=True)


if __name__ == "__main__":
  app.run(main)
