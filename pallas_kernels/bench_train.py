r"""Forward + backward benchmark of the sparse FFN (training): mosaic_gpu vs XLA dense (and xla).

    python -m pallas_kernels.benchmark --mode=fwd_bwd --specs=paper_16k,paper_16k_heavy \
        --impls=dense,mosaic_gpu,twell_dense,xla --out=/tmp/t.json

Timed unit: ``jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))`` with
loss = sum(y * ct) + lam * l1 (ct a fixed random cotangent, lam = 2e-5), i.e. the forward
and every gradient, for each implementation, in one process. Implementations: "dense" (the
XLA dense baseline, bf16 intermediates: ``xla_dense_ffn``; ratios are against it),
"mosaic_gpu", "twell_dense" (``twell_jax.ffn(implementation="dense")``) and "xla".
Median of synchronized wall-clock calls after warm-up. Also reported: bytes saved for the
backward (``saved_residuals``, weights excluded, x included for every implementation) and a
per-part breakdown of the mosaic path.
Inputs: ``twell_jax.testing.ffn_inputs`` (ordinary rows with a chosen active fraction; heavy
rows with about half their features active).

``bench_fwd_bwd(spec_name)`` is what the benchmark's fwd_bwd mode calls (this module has no
command line of its own).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp

import twell_jax as tj
from twell_jax import mosaic
from twell_jax.testing import ffn_inputs
from pallas_kernels import common
from pallas_kernels import ffn_mgpu
from pallas_kernels import ffn_train_mgpu
from pallas_kernels import gate_pack_mgpu
from pallas_kernels import train_bwd_mgpu
from pallas_kernels import train_fwd_mgpu

F32 = jnp.float32
LAMBDA = 2e-5


@dataclasses.dataclass(frozen=True)
class Spec:
  m: int
  d: int = 2048
  h: int = 5632
  active: float = 30.0          # mean active features per ordinary row
  heavy: float = 0.0            # fraction of heavy rows (~50% active)
  gated: bool = True
  ell_width: int = 128
  tail_rows: int | None = None  # None: M/8 (2048 at M=16384), like the reference


SPECS = {
    "tiny": Spec(128, 128, 256, active=8.0, heavy=0.02, ell_width=16),
    "small": Spec(2048, 1024, 2816),
    "paper_16k": Spec(16384),
    "paper_16k_heavy": Spec(16384, heavy=0.01),
    "paper_16k_w64": Spec(16384, ell_width=64),
}


def _time(f, *args, iters):
  """Median wall-clock ms of `iters` synchronized calls after warm-up."""
  return common.time_fn(f, *args, iters=iters, kernel_time=False)[0]


def _loss_fn(impl, spec: Spec, ct, interpret=False):
  def loss(x, wg, wu, wd):
    if impl == "mosaic_gpu":
      # Same custom VJP as tj.ffn(implementation="mosaic_gpu"); called directly so that
      # --interpret can smoke-test this file on a CPU.
      y, st = mosaic.mosaic_ffn(ffn_mgpu, x, wg, wu, wd, interpret=interpret,
                                ell_width=spec.ell_width, tail_rows=spec.tail_rows)
    elif impl == "xla":
      y, st = tj.ffn(x, wg, wu, wd, implementation="xla", return_stats=True,
                     ell_width=spec.ell_width, tail_rows=spec.tail_rows)
    elif impl == "twell_dense":
      y, st = tj.ffn(x, wg, wu, wd, implementation="dense", return_stats=True)
    else:  # "dense": the XLA dense baseline
      y, l1 = xla_dense_ffn(x, wg, wu, wd)
      return jnp.sum(y.astype(F32) * ct) + LAMBDA * l1
    return jnp.sum(y.astype(F32) * ct) + LAMBDA * st.l1
  return loss


def xla_dense_ffn(x, wg, wu, wd):
  """The XLA dense baseline (the north star's "XLA dense"): plain bf16 `x @ w` products (f32
  accumulation inside each GEMM, bf16 outputs), so the backward GEMMs are bf16 too; l1 =
  sum |h| / M. (Asking for f32 dot outputs and casting makes the backward's cotangents f32 and
  its GEMMs f32 x bf16: that variant measured 10.6 ms here, the H100 anchor is 4.875 ms.)"""
  if wg is not None:
    h = jnp.maximum(x @ wg, 0) * (x @ wu)
  else:
    h = jnp.maximum(x @ wu, 0)
  return h @ wd, jnp.sum(jnp.abs(h.astype(F32))) / x.shape[0]


def residual_report(spec: Spec, impls=("dense", "mosaic_gpu", "twell_dense", "xla")) -> dict:
  """Bytes saved for the backward per implementation (tracing only: runs on any host)."""
  x = jnp.zeros((spec.m, spec.d), jnp.bfloat16)
  wg = jnp.zeros((spec.d, spec.h), jnp.bfloat16)
  wd = jnp.zeros((spec.h, spec.d), jnp.bfloat16)
  out = {impl: residual_bytes(_loss_fn(impl, spec, 1.0), x, wg, wg, wd) for impl in impls}
  return {**out, **{f"{k}_ratio": v / out["dense"] for k, v in out.items()}}


def residual_bytes(loss, *args) -> int:
  """Bytes saved for the backward by jax.grad(loss), weights (args wg, wu, wd) excluded."""
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  total = 0
  for aval, desc in saved_residuals(loss, *args):
    if any(desc.startswith(f"from the argument {w}") for w in ("wg", "wu", "wd")):
      continue
    total += int(jnp.dtype(aval.dtype).itemsize) * math.prod(aval.shape)
  return total


def bench_fwd_bwd(name: str, iters: int = 20, impls=("dense", "mosaic_gpu", "twell_dense", "xla"),
                  parts: bool = True, spec: Spec | None = None, interpret=False,
                  breakdown: bool = False) -> dict:
  spec = spec or SPECS[name]
  x, wg, wu, wd = ffn_inputs(jax.random.key(0), spec.m, spec.d, spec.h,
                             active_fraction=spec.active / spec.h, heavy_fraction=spec.heavy,
                             gated=spec.gated)
  ct = jax.random.normal(jax.random.key(1), x.shape, F32)
  res = {"spec": name, **dataclasses.asdict(spec), "device": jax.devices()[0].device_kind,
         "jax": jax.__version__}
  argnums = (0, 1, 2, 3) if spec.gated else (0, 2, 3)
  grads = {}
  for impl in impls:
    t0 = time.time()
    try:
      loss = _loss_fn(impl, spec, ct, interpret)
      f = jax.jit(jax.grad(loss, argnums=argnums))
      res[f"{impl}_ms"] = _time(f, x, wg, wu, wd, iters=iters if impl != "xla" else 5)
      grads[impl] = f(x, wg, wu, wd)
      if breakdown:
        res[f"{impl}_pipelined_ms"] = common.pipelined_ms(f, x, wg, wu, wd, iters=iters)
        print(f"  {impl}: pipelined {res[f'{impl}_pipelined_ms']:.3f} ms/call", flush=True)
        res[f"{impl}_breakdown"] = common.print_breakdown(
            impl, common.kernel_breakdown(f, x, wg, wu, wd))
      # Residuals of the FFN alone: a scalar cotangent, so the loss saves no [M, D] constant.
      res[f"{impl}_residual_bytes"] = residual_bytes(_loss_fn(impl, spec, 1.0, interpret),
                                                     x, wg, wu, wd)
    except Exception as e:  # keep going: report the failure, time the rest
      res[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(f"  [{time.strftime('%X')}] {name} {impl}: {res.get(f'{impl}_ms')} ms "
          f"({time.time() - t0:.1f}s)", flush=True)
  if "dense_ms" in res:
    for impl in impls:
      if f"{impl}_ms" in res:
        res[f"{impl}_ratio"] = res[f"{impl}_ms"] / res["dense_ms"]
      if f"{impl}_residual_bytes" in res:
        res[f"{impl}_residual_ratio"] = (res[f"{impl}_residual_bytes"]
                                         / res["dense_residual_bytes"])
  # Gradient agreement with the dense XLA gradients (relative L2), a sanity check.
  if "dense" in grads:
    for impl in grads:
      if impl != "dense":
        errs = [float(jnp.linalg.norm(a.astype(F32) - b.astype(F32))
                      / jnp.maximum(jnp.linalg.norm(b.astype(F32)), 1e-30))
                for a, b in zip(grads[impl], grads["dense"])]
        res[f"{impl}_grad_rel_vs_dense"] = errs
  if parts and spec.gated:
    try:
      res.update(_parts(spec, x, wg, wu, wd, ct, iters))
    except Exception as e:
      res["parts_error"] = f"{type(e).__name__}: {str(e)[:400]}"
  return res


def _parts(spec: Spec, x, wg, wu, wd, ct, iters):
  """Per-stage times of the mosaic path (each stage jitted alone; sums exceed the fused total)."""
  out = {}
  cfg = ffn_train_mgpu.make_config(spec.m, spec.d, spec.h, spec.ell_width, spec.tail_rows)
  fwd = jax.jit(lambda *a: ffn_train_mgpu.forward(cfg, *a))
  out["part_forward_ms"] = _time(fwd, x, wg, wu, wd, iters=iters)
  outputs, resid = fwd(x, wg, wu, wd)
  out["heavy_rows"] = int(outputs[4])
  out["nnz_per_token"] = float(outputs[2])
  out["max_tile_nnz"] = int(outputs[3])
  dy = (ct * 1.0).astype(x.dtype)
  bwd = jax.jit(lambda r, d_: ffn_train_mgpu.backward(cfg, r, (d_, jnp.float32(LAMBDA))))
  out["part_backward_ms"] = _time(bwd, resid, dy, iters=iters)
  out["part_inference_forward_ms"] = _time(jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a)[0]),
                                           x, wg, wu, wd, iters=iters)
  gp = jax.jit(lambda a, b: gate_pack_mgpu.gate_pack(a, b))
  out["part_gate_pack_ms"] = _time(gp, x, wg, iters=iters)
  words, counts = gp(x, wg)
  hyb = jax.jit(lambda w, c: ffn_train_mgpu._hybrid_from_twell(cfg, w, c))  # pylint: disable=protected-access
  out["part_twell_to_ell_ms"] = _time(hyb, words, counts, iters=iters)
  cols, p, n, _, _ = hyb(words, counts)
  wut, wgt = wu.T, wg.T
  for g in (4, 8):
    f = jax.jit(functools.partial(train_fwd_mgpu.ell_up_down, group=g))
    out[f"part_ell_up_down_g{g}_ms"] = _time(f, x, cols, p, n, wut, wd, iters=iters)
  _, u, _ = train_fwd_mgpu.ell_up_down(x, cols, p, n, wut, wd)
  u = u.astype(x.dtype)
  c = jnp.full((1,), LAMBDA / spec.m, F32)
  for g in (4, 8):
    f = jax.jit(functools.partial(train_bwd_mgpu.ell_bwd_rows, group=g))
    out[f"part_bwd_rows_g{g}_ms"] = _time(f, dy, cols, p, u, n, c, wd, wut, wgt, iters=iters)
  _, du, dg = train_bwd_mgpu.ell_bwd_rows(dy, cols, p, u, n, c, wd, wut, wgt)
  csc = jax.jit(lambda c_, n_: ffn_train_mgpu._csc(cfg, c_, n_))  # pylint: disable=protected-access
  out["part_csc_sort_ms"] = _time(csc, cols, n, iters=iters)
  col_ptr, sid = csc(cols, n)
  rows = sid // cfg.wk
  flat = lambda a: a.reshape(-1)[sid].astype(F32)
  du_s, dg_s, h_s = flat(du), flat(dg), flat(p)
  for g in (4, 8):
    f = jax.jit(functools.partial(train_bwd_mgpu.csc_weight_grads, group=g))
    out[f"part_wgrads_g{g}_ms"] = _time(f, x, dy, col_ptr, rows, du_s, dg_s, h_s, iters=iters)
  xla_gate = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32).astype(a.dtype))
  out["part_xla_gate_gemm_ms"] = _time(xla_gate, x, wg, iters=iters)
  return out
