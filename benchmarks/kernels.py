r"""Kernel benchmark: the sparse FFN against XLA dense on the same inputs, in one process.

    python -m benchmarks.kernels --mode=fwd --specs=paper_16k,paper_16k_skew --out=fwd.json
    python -m benchmarks.kernels --mode=fwd_bwd --specs=paper_16k,paper_16k_heavy --out=t.json

* ``fwd``: the inference forward (``pallas_kernels.ffn_mgpu.ffn_forward``, y only) against the
  dense FFN (``pallas_kernels.reference.dense_ffn_hidden``: the "dense" implementation).
* ``fwd_bwd``: ``jax.jit(jax.grad(loss))`` of loss = sum(y * ct) + 2e-5 * l1 (ct a fixed
  random cotangent) per implementation of ``twell_jax.ffn`` (``--impls``; "dense" is the
  baseline every ratio is against), plus the bytes each saves for the backward (weights
  excluded) and the gradients' relative error against dense's.
Inputs come from ``benchmarks.common.specs`` (uniform, heavy-row and skewed activity), with the hidden
features sorted by their activity on x and the features above the 1% break-even rate computed
as dense GEMMs (``hot_features``, ``twell_jax.features.calibrate``; 0 for uniform activity), as
a model that keeps its features sorted runs them. Times: medians of synchronized calls
(``benchmarks.common.timing.wall_ms``: "ratio"; each call also pays the host's launch and wait,
~0.3 ms at the paper shape for either implementation), back-to-back calls (``pipelined_ms``:
"piped", as in a model's step, where nothing waits for each FFN) and the device time, all
kernels summed (``device_ms``, CUPTI: "device"); ``--breakdown`` adds each kernel's device
time. Each spec's result is printed as JSON and the list so far rewritten to ``--out`` after
every spec. ``--interpret`` runs the
kernels in the Mosaic GPU interpreter (a CPU smoke test of this file; use the ``tiny`` specs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import traceback

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import specs as specs_lib
from benchmarks.common import timing
from pallas_kernels import ffn_mgpu
from pallas_kernels import ffn_train_mgpu
from pallas_kernels import reference
from twell_jax import testing

F32 = jnp.float32


def _define_flags():
  """The command line (defined when run as a program, so other modules can import this one)."""
  flags.DEFINE_enum("mode", "fwd", ["fwd", "fwd_bwd"], "what to time (module docstring)")
  flags.DEFINE_list("specs", ["paper_16k", "paper_16k_heavy", "paper_16k_skew"],
                    "benchmarks.common.specs names")
  flags.DEFINE_list("impls", ["dense", "mosaic_gpu"],
                    "fwd_bwd: twell_jax.ffn implementations (dense is the baseline)")
  flags.DEFINE_integer("iters", 30, "timed calls per measurement")
  flags.DEFINE_bool("breakdown", False, "per-kernel device times (CUPTI)")
  flags.DEFINE_bool("interpret", False, "run the kernels in the interpreter (CPU)")
  flags.DEFINE_string("out", None, "write the results as JSON here")


def _dense_y(x, wg, wu, wd):
  return reference.dense_ffn_hidden(x, wg, wu, wd)[0]


def input_stats(spec: specs_lib.Spec, x, wg, wu) -> dict:
  """Activity statistics of the spec's gate (`twell_jax.testing.activity_stats`)."""
  pre = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32) > 0)(
      x, wg if spec.gated else wu)
  return testing.activity_stats(np.asarray(pre))


def bench_fwd(spec: specs_lib.Spec, iters: int, interpret: bool, breakdown: bool) -> dict:
  (x, wg, wu, wd), k = specs_lib.calibrated_inputs(spec)
  res = {"hot_features": k}
  fwd_cfg = ffn_mgpu.ForwardConfig(hot_features=k)
  dense = jax.jit(_dense_y)
  sparse = jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a, config=fwd_cfg, interpret=interpret)[0])
  with_stats = jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a, config=fwd_cfg, interpret=interpret))
  res["dense_ms"] = timing.wall_ms(dense, x, wg, wu, wd, iters=iters)
  res["twell_ms"] = timing.wall_ms(sparse, x, wg, wu, wd, iters=iters)
  res["twell_with_stats_ms"] = timing.wall_ms(with_stats, x, wg, wu, wd, iters=iters)
  res["ratio"] = res["twell_ms"] / res["dense_ms"]
  res["dense_pipelined_ms"] = timing.pipelined_ms(dense, x, wg, wu, wd, iters=iters)
  res["twell_pipelined_ms"] = timing.pipelined_ms(sparse, x, wg, wu, wd, iters=iters)
  res["pipelined_ratio"] = res["twell_pipelined_ms"] / res["dense_pipelined_ms"]
  res["dense_device_ms"] = timing.device_ms(dense, x, wg, wu, wd)
  res["twell_device_ms"] = timing.device_ms(sparse, x, wg, wu, wd)
  if res["dense_device_ms"] and res["twell_device_ms"]:
    res["device_ratio"] = res["twell_device_ms"] / res["dense_device_ms"]
  # The training path's forward (hybrid ELL layout, hot features dense), y only.
  cfg = ffn_train_mgpu.hybrid_config(spec.m, spec.d, spec.h, spec.ell_width, spec.tail_rows,
                                     hot_features=k)
  hybrid = jax.jit(lambda *a: ffn_train_mgpu.forward(cfg, *a, interpret=interpret)[0][0])
  res["hybrid_ms"] = timing.wall_ms(hybrid, x, wg, wu, wd, iters=iters)
  res["hybrid_ratio"] = res["hybrid_ms"] / res["dense_ms"]
  y, st = with_stats(x, wg, wu, wd)
  st = jax.device_get(st)
  res.update(nnz_per_token=float(st["nnz_per_token"]), overflow_rows=int(st["overflow_rows"]),
             max_tile_nnz=int(st["max_tile_nnz"]))
  ref, _ = reference.reference_ffn_hidden(x, wg, wu, wd)
  res["rel_err"] = float(jnp.linalg.norm(y.astype(F32) - ref) / jnp.linalg.norm(ref))
  if breakdown:
    for label, fn in (("dense", dense), ("twell", sparse)):
      res[f"{label}_breakdown"] = timing.summarize_breakdown(
          label, timing.kernel_breakdown(fn, x, wg, wu, wd))
  res["input"] = input_stats(spec, x, wg, wu)
  return res


def saved_residual_bytes(loss, *args) -> int:
  """Bytes saved for the backward by jax.grad(loss), the weights (args 1-3) excluded."""
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  total = 0
  for aval, desc in saved_residuals(loss, *args):
    if any(desc.startswith(f"from the argument {w}") for w in ("wg", "wu", "wd")):
      continue
    total += int(jnp.dtype(aval.dtype).itemsize) * math.prod(aval.shape)
  return total


def bench_fwd_bwd(spec: specs_lib.Spec, iters: int, impls, interpret: bool,
                  breakdown: bool) -> dict:
  (x, wg, wu, wd), k = specs_lib.calibrated_inputs(spec)
  ct = jax.random.normal(jax.random.key(1), x.shape, F32)
  argnums = (0, 1, 2, 3) if spec.gated else (0, 2, 3)
  res, grads = {"hot_features": k}, {}
  for impl in impls:
    t0 = time.time()
    try:
      f = jax.jit(jax.grad(specs_lib.loss_fn(impl, spec, interpret, k), argnums=argnums))
      args = (x, wg, wu, wd, ct)
      res[f"{impl}_ms"] = timing.wall_ms(f, *args, iters=iters if impl != "xla" else 3)
      grads[impl] = f(*args)
      # The FFN's own residuals: a scalar cotangent, so the loss saves no [M, D] array.
      res[f"{impl}_residual_bytes"] = saved_residual_bytes(
          specs_lib.loss_fn(impl, spec, interpret, k), x, wg, wu, wd, F32(1.0))
      res[f"{impl}_pipelined_ms"] = timing.pipelined_ms(f, *args, iters=iters)
      res[f"{impl}_device_ms"] = timing.device_ms(f, *args)
      if breakdown:
        res[f"{impl}_breakdown"] = timing.summarize_breakdown(
            impl, timing.kernel_breakdown(f, *args))
    except Exception as e:  # pylint: disable=broad-except  # report it, time the rest
      traceback.print_exc()
      res[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(f"  [{time.strftime('%X')}] {impl}: {res.get(f'{impl}_ms')} ms "
          f"({time.time() - t0:.1f}s)", flush=True)
  for impl in impls:
    if f"{impl}_ms" in res and "dense_ms" in res:
      res[f"{impl}_ratio"] = res[f"{impl}_ms"] / res["dense_ms"]
      res[f"{impl}_pipelined_ratio"] = (res[f"{impl}_pipelined_ms"]
                                        / res["dense_pipelined_ms"])
      res[f"{impl}_residual_ratio"] = (res[f"{impl}_residual_bytes"]
                                       / res["dense_residual_bytes"])
      if res.get(f"{impl}_device_ms") and res.get("dense_device_ms"):
        res[f"{impl}_device_ratio"] = res[f"{impl}_device_ms"] / res["dense_device_ms"]
    if impl in grads and "dense" in grads and impl != "dense":
      res[f"{impl}_grad_rel_vs_dense"] = [
          float(jnp.linalg.norm(a.astype(F32) - b.astype(F32))
                / jnp.maximum(jnp.linalg.norm(b.astype(F32)), 1e-30))
          for a, b in zip(grads[impl], grads["dense"])]
  res["input"] = input_stats(spec, x, wg, wu)
  return res


def _print_table(mode: str, results: list[dict], impls) -> None:
  print()
  if mode == "fwd":
    print(f"{'spec':<22}{'dense ms':>10}{'twell ms':>10}{'ratio':>8}{'piped':>8}{'device':>8}"
          f"{'+stats':>8}"
          f"{'hybrid':>8}{'ratio':>8}{'nnz':>7}{'ovf':>7}{'relerr':>10}")
  else:
    print(f"{'spec':<22}" + "".join(f"{i + ' ms':>16}{'ratio':>8}{'piped':>8}{'device':>8}"
                                    for i in impls)
          + f"{'residual':>10}")
  for r in results:
    if "error" in r:
      print(f"{r['spec']:<22} ERROR {r['error'][:100]}")
    elif mode == "fwd":
      print(f"{r['spec']:<22}{r['dense_ms']:>10.3f}{r['twell_ms']:>10.3f}{r['ratio']:>8.3f}"
            f"{r['pipelined_ratio']:>8.3f}{r.get('device_ratio', math.nan):>8.3f}"
            f"{r['twell_with_stats_ms']:>8.3f}{r['hybrid_ms']:>8.3f}{r['hybrid_ratio']:>8.3f}"
            f"{r['nnz_per_token']:>7.1f}"
            f"{r['overflow_rows']:>7d}{r['rel_err']:>10.2e}")
    else:
      row = f"{r['spec']:<22}"
      for i in impls:
        row += (f"{r.get(i + '_ms', math.nan):>16.3f}{r.get(i + '_ratio', math.nan):>8.3f}"
                f"{r.get(i + '_pipelined_ratio', math.nan):>8.3f}"
                f"{r.get(i + '_device_ratio', math.nan):>8.3f}")
      print(row + f"{r.get('mosaic_gpu_residual_ratio', math.nan):>10.3f}")


def main(argv):
  del argv
  fl = flags.FLAGS
  device = jax.devices()[0].device_kind
  print("device:", device, "jax", jax.__version__, flush=True)
  results = []
  for name in fl.specs:
    spec = specs_lib.get(name)
    iters = fl.iters if spec.m <= 16384 else max(5, fl.iters // 4)
    t0 = time.time()
    try:
      if fl.mode == "fwd":
        r = bench_fwd(spec, iters, fl.interpret, fl.breakdown)
      else:
        r = bench_fwd_bwd(spec, iters, fl.impls, fl.interpret, fl.breakdown)
    except Exception as e:  # pylint: disable=broad-except  # one spec must not hide the others
      traceback.print_exc()
      r = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    r = {"spec": name, "mode": fl.mode, **dataclasses.asdict(spec), "device": device,
         "jax": jax.__version__, "seconds": round(time.time() - t0, 1), **r}
    results.append(r)
    print(json.dumps({k: v for k, v in r.items() if not k.endswith("breakdown")}), flush=True)
    if fl.out:
      with open(fl.out, "w") as f:
        json.dump(results, f, indent=1)
  _print_table(fl.mode, results, fl.impls)


if __name__ == "__main__":
  _define_flags()
  jax.config.config_with_absl()
  app.run(main)
