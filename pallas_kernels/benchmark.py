r"""Benchmark of the Mosaic GPU TwELL FFN forward against XLA dense, in one process.

    python -m pallas_kernels.benchmark --specs=paper_16k,paper_16k_heavy --out=/tmp/b.json

Inputs are synthetic: x[:, 0] = 1 and w_gate[0, :] = -c put the gate pre-activations at
N(-c, ~1), giving a chosen mean number of active features per row; heavy rows get x[:, 0] = 0
(~50% active). Times are medians of --iters synchronized wall-clock calls after warm-up
(and, where CUPTI works, the kernel-only time from mosaic's profiler).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels import ffn_mgpu
from pallas_kernels import gate_pack_mgpu
from pallas_kernels import sparse_down_mgpu

_SPECS = flags.DEFINE_list("specs", ["paper_16k", "paper_16k_heavy", "paper_16k_a60"],
                           "named shape specs to run")
_OUT = flags.DEFINE_string("out", None, "write results as JSON here")
_ITERS = flags.DEFINE_integer("iters", 30, "timed iterations")
_PARTS = flags.DEFINE_bool("parts", True, "also time the gate kernel and the fused kernel alone")
_GROUPS = flags.DEFINE_list("groups", ["1", "4"], "sparse_down tile-group sizes to time")
_FWD_GROUPS = flags.DEFINE_list("fwd_groups", ["4"], "also time the whole forward with these "
                                "sparse_down group sizes (the default one is the headline)")
_CHECK = flags.DEFINE_bool("check", True, "check the output against the f32 reference")
_MODE = flags.DEFINE_enum("mode", "fwd", ["fwd", "fwd_bwd"],
                          "fwd: inference forward (this module's specs); fwd_bwd: forward + backward "
                          "of the loss sum(y * ct) + 2e-5 * l1 (pallas_kernels.bench_train specs)")
_BREAKDOWN = flags.DEFINE_bool("breakdown", False,
                                "also print each kernel's device time (CUPTI) and the pipelined "
                                "wall time (back-to-back calls, one sync) of dense and twell")
_IMPLS = flags.DEFINE_list("impls", ["dense", "mosaic_gpu"],
                           "fwd_bwd mode: implementations to time (dense = the XLA dense baseline; "
                           "also twell_dense, xla)")


@dataclasses.dataclass(frozen=True)
class Spec:
  m: int
  d: int = 2048
  h: int = 5632
  active: float = 30.0
  heavy: float = 0.0
  gated: bool = True


SPECS = {
    "small": Spec(2048),
    "paper_16k": Spec(16384),
    "paper_16k_heavy": Spec(16384, heavy=0.01),
    "paper_16k_a60": Spec(16384, active=60.0),
    "paper_16k_nongated": Spec(16384, gated=False),
    "paper_131k": Spec(131072),
}


def make_inputs(spec: Spec, seed: int = 0):
  from scipy.stats import norm
  ks = jax.random.split(jax.random.key(seed), 4)
  c = float(norm.isf(spec.active / spec.h))
  x = jax.random.normal(ks[0], (spec.m, spec.d), jnp.bfloat16).at[:, 0].set(1.0)
  n_heavy = int(round(spec.heavy * spec.m))
  if n_heavy:
    rows = np.random.default_rng(seed).choice(spec.m, n_heavy, replace=False)
    x = x.at[rows, 0].set(0.0)
  wg = (jax.random.normal(ks[1], (spec.d, spec.h), jnp.float32) / np.sqrt(spec.d - 1))
  wg = wg.at[0].set(-c).astype(jnp.bfloat16)
  wu = (jax.random.normal(ks[2], (spec.d, spec.h), jnp.float32) / np.sqrt(spec.d))
  wd = (jax.random.normal(ks[3], (spec.h, spec.d), jnp.float32) / np.sqrt(spec.h))
  wu, wd = wu.astype(jnp.bfloat16), wd.astype(jnp.bfloat16)
  if spec.gated:
    return x, wg, wu, wd
  return x, None, wg, wd


@jax.jit
def dense_ffn(x, wg, wu, wd):
  """XLA dense baseline: plain bf16 products (f32 accumulation inside each GEMM), as a bf16
  model is written. (Runs before 2026-11-21 20:55 used f32 dot outputs cast to bf16; see PERF.md.)"""
  if wg is not None:
    h = jnp.maximum(x @ wg, 0) * (x @ wu)
  else:
    h = jnp.maximum(x @ wu, 0)
  return h @ wd


def run_spec(name: str, spec: Spec, iters: int):
  x, wg, wu, wd = make_inputs(spec)
  m, d, h = spec.m, spec.d, spec.h
  res = {"spec": name, **dataclasses.asdict(spec), "device": jax.devices()[0].device_kind}
  t0 = time.time()
  dense_ms, dense_k, y_dense = common.time_fn(dense_ffn, x, wg, wu, wd, iters=iters)
  print(f"  [{time.strftime('%X')}] {name}: dense {dense_ms:.3f} ms ({time.time() - t0:.1f}s)",
        flush=True)
  n_gemm = 3 if spec.gated else 2
  res["dense_ms"], res["dense_kernel_ms"] = dense_ms, dense_k
  res["dense_tflops"] = n_gemm * 2 * m * d * h / dense_ms / 1e9

  fwd = jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a)[0])
  fwd_stats = jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a))
  t0 = time.time()
  ms, k_ms, y = common.time_fn(fwd, x, wg, wu, wd, iters=iters)
  print(f"  [{time.strftime('%X')}] {name}: twell {ms:.3f} ms ({time.time() - t0:.1f}s)",
        flush=True)
  res["twell_ms"], res["twell_kernel_ms"] = ms, k_ms
  res["ratio"] = ms / dense_ms
  if _BREAKDOWN.value:
    for label, fn in (("dense", dense_ffn), ("twell", fwd)):
      res[f"{label}_pipelined_ms"] = common.pipelined_ms(fn, x, wg, wu, wd, iters=iters)
      print(f"  {label}: pipelined {res[f'{label}_pipelined_ms']:.3f} ms/call", flush=True)
      res[f"{label}_breakdown"] = common.print_breakdown(
          label, common.kernel_breakdown(fn, x, wg, wu, wd))
  for gsz in [int(v) for v in _FWD_GROUPS.value]:
    f_g = jax.jit(lambda *a, gsz=gsz: ffn_mgpu.ffn_forward(*a, group=gsz)[0])
    ms_g, _, _ = common.time_fn(f_g, x, wg, wu, wd, iters=iters)
    res[f"twell_group{gsz}_ms"], res[f"ratio_group{gsz}"] = ms_g, ms_g / dense_ms
    print(f"  [{time.strftime('%X')}] {name}: twell group={gsz} {ms_g:.3f} ms "
          f"ratio {ms_g / dense_ms:.3f}", flush=True)
  _, stats = fwd_stats(x, wg, wu, wd)
  stats = jax.device_get(stats)
  nnz = float(stats["nnz_per_token"])
  res["nnz_per_token"] = nnz
  res["overflow_rows"] = int(stats["overflow_rows"])
  res["max_tile_nnz"] = int(stats["max_tile_nnz"])
  ms_s, _, _ = common.time_fn(fwd_stats, x, wg, wu, wd, iters=max(iters // 3, 5))
  res["twell_with_stats_ms"] = ms_s
  # Effective rates: useful FLOPs (gate GEMM + 2 or 1 D-long products per active entry).
  flops = 2 * m * d * h + (4 if spec.gated else 2) * m * nnz * d
  res["eff_tflops"] = flops / ms / 1e9
  # Bytes: x, w_gate once, packed words/counts, weight rows per active entry, y.
  rows_bytes = (2 if spec.gated else 1) * m * nnz * d * 2
  res["gathered_GB"] = rows_bytes / 1e9
  res["eff_GBps"] = (rows_bytes + 2 * m * d * 2 + 2 * d * h) / ms / 1e6
  if _CHECK.value:
    ref, _ = ffn_mgpu.reference_forward(x, wg, wu, wd)
    y32 = y.astype(jnp.float32)
    res["rel_err"] = float(jnp.linalg.norm(y32 - ref) / jnp.linalg.norm(ref))
    res["dense_rel_err"] = float(jnp.linalg.norm(y_dense.astype(jnp.float32) - ref)
                                 / jnp.linalg.norm(ref))
    res["max_abs_err"] = float(jnp.max(jnp.abs(y32 - ref)))
  if _PARTS.value:
    gp = jax.jit(lambda a, b: gate_pack_mgpu.gate_pack(a, b))
    res["gate_pack_ms"], res["gate_pack_kernel_ms"], (words, counts) = common.time_fn(
        gp, x, wg if spec.gated else wu, iters=iters)
    xla_gate = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
                       .astype(jnp.bfloat16))
    res["xla_gate_gemm_ms"], _, _ = common.time_fn(xla_gate, x, wg if spec.gated else wu,
                                            iters=iters)
    row_ok = jnp.ones((m,), jnp.int32)
    wup_t = wu.T if spec.gated else None
    for gsz in [int(v) for v in _GROUPS.value]:
      sd = jax.jit(functools.partial(sparse_down_mgpu.sparse_down, group=gsz))
      t0 = time.time()
      ms_g, k_g, _ = common.time_fn(sd, x, words, counts, row_ok, wup_t, wd, iters=iters)
      res[f"sparse_down_g{gsz}_ms"], res[f"sparse_down_g{gsz}_kernel_ms"] = ms_g, k_g
      print(f"  [{time.strftime('%X')}] sparse_down group={gsz}: {ms_g:.3f} ms "
            f"(kernel {k_g}) ({time.time() - t0:.1f}s)", flush=True)
    res["sparse_down_ms"] = res.get(f"sparse_down_g{_GROUPS.value[0]}_ms")
  return res


def run_specs(run_one) -> list[dict]:
  """Runs `run_one(name)` for each --specs name; a failing spec is reported, not fatal.

  Each result is printed as JSON and the list so far is rewritten to --out after every spec,
  so a run cut off by a timeout still leaves what it measured.
  """
  results = []
  for name in _SPECS.value:
    try:
      r = run_one(name)
    except Exception as e:  # keep going: one failing spec must not hide the others
      import traceback  # pylint: disable=import-outside-toplevel
      traceback.print_exc()
      r = {"spec": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    results.append(r)
    print(json.dumps(r), flush=True)
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump(results, f, indent=1)
  return results


def main_fwd_bwd():
  """Forward + backward mode: delegates to pallas_kernels.bench_train (same process, same table)."""
  from pallas_kernels import bench_train  # pylint: disable=import-outside-toplevel
  results = run_specs(lambda name: bench_train.bench_fwd_bwd(
      name, _ITERS.value, tuple(_IMPLS.value), parts=_PARTS.value,
      breakdown=_BREAKDOWN.value))
  print(f"\n{'spec':<20}" + "".join(f"{i + ' ms':>16}{'ratio':>8}" for i in _IMPLS.value)
        + f"{'residual ratio':>16}")
  for r in results:
    if "error" in r:
      print(f"{r['spec']:<20} ERROR {r['error'][:100]}")
      continue
    row = f"{r['spec']:<20}"
    for i in _IMPLS.value:
      row += f"{r.get(i + '_ms', float('nan')):>16.3f}{r.get(i + '_ratio', float('nan')):>8.3f}"
    print(row + f"{r.get('mosaic_gpu_residual_ratio', float('nan')):>16.3f}")


def main(argv):
  del argv
  print("device:", jax.devices()[0].device_kind, "jax", jax.__version__)
  if _MODE.value == "fwd_bwd":
    main_fwd_bwd()
    return

  def run_one(name):
    spec = SPECS[name]
    return run_spec(name, spec, _ITERS.value if spec.m <= 16384 else max(5, _ITERS.value // 4))

  results = run_specs(run_one)
  print()
  hdr = (f"{'spec':<20}{'dense ms':>10}{'twell ms':>10}{'ratio':>8}{'+stats':>8}{'gate':>8}"
         f"{'xlagate':>8}{'down':>8}{'nnz':>7}{'ovf':>6}{'TF/s':>7}{'GB/s':>8}{'relerr':>9}")
  print(hdr)
  for r in results:
    if "error" in r:
      print(f"{r['spec']:<20} ERROR {r['error'][:100]}")
      continue
    g = lambda k: r.get(k) or float("nan")
    print(f"{r['spec']:<20}{r['dense_ms']:>10.3f}{r['twell_ms']:>10.3f}{r['ratio']:>8.3f}"
          f"{g('twell_with_stats_ms'):>8.3f}{g('gate_pack_ms'):>8.3f}{g('xla_gate_gemm_ms'):>8.3f}"
          f"{g('sparse_down_ms'):>8.3f}{r['nnz_per_token']:>7.1f}{r['overflow_rows']:>6d}"
          f"{r['eff_tflops']:>7.0f}{r['eff_GBps']:>8.0f}{g('rel_err'):>9.2e}")


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main)
