"""Column-side dh + dW_down with one CSC entry per *warp* (Mosaic GPU, Hopper; GPU only).

Same contract and outputs as ``train_bwd_mgpu.csc_down_dh`` (read its docstring for the math:
per hidden column j, dh_e = dy[rows_e] . W_down[j] + c sign(h_e) for each of the column's
entries e, du_e = dh_e p_e, dg_e = dh_e u_e, dW_down[j] = sum_e h_e dy[rows_e]); what differs
is who does what inside the CTA (one CTA, one warpgroup, per column j):

* ``csc_down_dh``: the warpgroup takes the column's entries one at a time. Each entry's dot is
  spread over 128 threads, so it ends in 5 shuffles and a cross-warp SMEM exchange between two
  warpgroup barriers, and each entry's du / dg stores wait for that.
* here: warp w takes entries start + w, start + w + 4, ... on its own. Each lane holds 64 of
  the D = 2048 elements (8-element vectors at lane * 8 + 256 v), W_down[j] and its own f32
  partial of dW_down[j] in registers; a dot ends in 5 shuffles within the warp and nothing
  else, so the four warps never wait for each other until the column's end, where the four
  dW_down partials are added through SMEM (one barrier per column).

Why it may be faster (PERF.md, ninth session): the dot costs csc_down_dh 0.15 ms, and fewer
barriers alone did not help; here each entry costs one warp ~215 instructions instead of four
warps ~330, and four entries per CTA are in flight instead of one.

The body is raw Mosaic GPU (``plgpu.inline_mgpu``: per-warp row addresses are not expressible
in Pallas' Lane semantics), which has no interpreter rule: use ``csc_down_dh`` under
interpret mode. Supported: D % 256 == 0, bf16 dy, W_down and gate / up values. The sums are the same as ``csc_down_dh``'s in another
order (dh and dW_down differ from it in the last bits).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector

from pallas_kernels import common

_F32 = jnp.float32
_WARP = 32
_WARPS = 4
_VEC = 8                      # bf16 elements per lane per load (16 bytes)
_SPAN = _WARP * _VEC          # 256: columns one warp-wide load covers


def supported(d: int, *dtypes) -> bool:
  """D % 256 == 0 and bf16 dy / W_down / p / u (the loads are 16-byte bf16 vectors)."""
  return d % _SPAN == 0 and all(jnp.dtype(t) == jnp.bfloat16 for t in dtypes)


def csc_down_dh_warps(dy, w_down, col_ptr, rows, p, u, c, ids, ell_shape, *, out_dtype=_F32):
  """``csc_down_dh``'s outputs (dW_down, du or None, dg, du_ell or None, dg_ell) computed with
  one entry per warp; arguments as there (no group / rows_ahead / interpret)."""
  m, d = dy.shape
  hh = col_ptr.shape[0] - 1
  e = rows.shape[0]
  gated = u is not None
  n_ell = ell_shape[0] * ell_shape[1]
  if (not supported(d, dy.dtype, w_down.dtype, p.dtype, *([u.dtype] if gated else []))
      or w_down.shape != (hh, d) or tuple(p.shape) != tuple(ell_shape)
      or (gated and u.shape != p.shape) or ids.shape != (e,) or n_ell < e):
    raise ValueError(f"csc_down_dh_warps: bad shapes or dtypes (D % {_SPAN} == 0 and bf16 "
                     f"needed) {dy.shape=} {dy.dtype=} {w_down.shape=} {w_down.dtype=} "
                     f"{col_ptr.shape=} {rows.shape=} {p.shape=} {p.dtype=} {ids.shape=} "
                     f"{ell_shape=}")
  del m
  p = p.reshape(n_ell)
  u = u.reshape(n_ell) if gated else p          # (not read when non-gated)
  coef_t = jax.ShapeDtypeStruct((e,), _F32)
  ell_t = jax.ShapeDtypeStruct((n_ell,), _F32)
  dummy = jax.ShapeDtypeStruct((8,), _F32)
  f = plgpu.kernel(
      functools.partial(_kernel, gated=gated),
      out_type=(jax.ShapeDtypeStruct((hh, d), out_dtype), coef_t if gated else dummy, coef_t,
                ell_t if gated else dummy, ell_t),
      scratch_types=[plgpu.SMEM((_WARPS, d), _F32)],
      grid=(hh,), grid_names=("j",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      kernel_name="twell_train_wgrad_down_dh_warps",
  )
  dwd, du, dg, du_ell, dg_ell = f(dy, w_down, col_ptr, rows, p, u,
                                  c.astype(_F32).reshape(1), ids)
  return (dwd, (du if gated else None), dg,
          du_ell.reshape(ell_shape) if gated else None, dg_ell.reshape(ell_shape))


def _kernel(*refs, gated: bool):
  j = lax.axis_index("j")
  fn = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT(()),) + (plgpu.RefType(),) * 14)(
      functools.partial(_body, gated=gated))
  fn(j, *refs)


def _c(v, ty):
  return arith.constant(ty, v)


def _body(ctx, j_fa, dy, wd, ptr, rows, p, u, c_ref, ids, dwd, du, dg, du_ell, dg_ell,
          scratch, *, gated: bool):
  """The per-column program (module docstring); all values are per thread."""
  del ctx
  f32, bf16 = ir.F32Type.get(), ir.BF16Type.get()
  i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
  d = ir.MemRefType(dy.type).shape[1]
  n_vec = d // _SPAN
  v8f32, v8bf16 = ir.VectorType.get((_VEC,), f32), ir.VectorType.get((_VEC,), bf16)
  idx = lambda v: arith.index_cast(index, v)

  j = j_fa.registers.flat[0]
  if isinstance(j.type, ir.VectorType):
    j = vector.extract(j, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
  tid = mgpu_utils.thread_idx()
  lane = arith.remui(tid, _c(_WARP, i32))
  warp = arith.divui(arith.remui(tid, _c(_WARP * _WARPS, i32)), _c(_WARP, i32))
  lane_col = arith.muli(lane, _c(_VEC, i32))
  cols = [idx(arith.addi(lane_col, _c(_SPAN * v, i32))) for v in range(n_vec)]

  start = memref.load(ptr, [idx(j)])
  end = memref.load(ptr, [idx(arith.addi(j, _c(1, i32)))])
  c = memref.load(c_ref, [_c(0, index)])
  w = [arith.extf(v8f32, vector.load(v8bf16, wd, [idx(j), col])) for col in cols]
  zero = arith.constant(v8f32, ir.DenseElementsAttr.get_splat(v8f32, ir.FloatAttr.get(f32, 0.0)))

  # Entries start + warp + 4 i for i < trips.
  first = arith.addi(start, warp)
  left = arith.maxsi(arith.subi(end, first), _c(0, i32))
  trips = arith.divui(arith.addi(left, _c(_WARPS - 1, i32)), _c(_WARPS, i32))
  is_lane0 = arith.cmpi(arith.CmpIPredicate.eq, lane, _c(0, i32))

  @mgpu_utils.fori(idx(trips), [zero] * n_vec)
  def acc(i, acc):
    e = arith.addi(first, arith.muli(arith.index_cast(i32, i), _c(_WARPS, i32)))
    e_idx = idx(e)
    r = memref.load(rows, [e_idx])
    slot = idx(memref.load(ids, [e_idx]))
    p_bf = memref.load(p, [slot])
    pv = arith.extf(f32, p_bf)
    if gated:
      uv = arith.extf(f32, memref.load(u, [slot]))
      # h as the forward rounded it: bf16(p u) in the residuals' dtype.
      hv = arith.extf(f32, arith.truncf(p_bf.type, arith.mulf(pv, uv)))
    else:
      uv, hv = None, pv
    hvec = vector.broadcast(v8f32, hv)
    row = [arith.extf(v8f32, vector.load(v8bf16, dy, [idx(r), col])) for col in cols]
    new_acc = [vector.fma(hvec, rv, a) for rv, a in zip(row, acc)]
    prods = [arith.mulf(rv, wv) for rv, wv in zip(row, w)]
    while len(prods) > 1:
      prods = ([arith.addf(a, b) for a, b in zip(prods[::2], prods[1::2])]
               + prods[len(prods) - len(prods) % 2:])
    part = prods[0]
    elems = [vector.extract(part, dynamic_position=[],
                            static_position=ir.DenseI64ArrayAttr.get([k])) for k in range(_VEC)]
    while len(elems) > 1:
      elems = [arith.addf(a, b) for a, b in zip(elems[::2], elems[1::2])]
    dot = elems[0]
    dist = _WARP // 2
    while dist >= 1:
      dot = arith.addf(dot, mgpu_utils.shfl_bfly(dot, dist))
      dist //= 2
    one, mone, fzero = _c(1.0, f32), _c(-1.0, f32), _c(0.0, f32)
    sign = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, hv, fzero), one,
                        arith.select(arith.cmpf(arith.CmpFPredicate.OLT, hv, fzero), mone,
                                     fzero))
    dh = arith.addf(dot, arith.mulf(c, sign))
    dh = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, pv, fzero), dh, fzero)
    with mgpu_utils.when(is_lane0):
      if gated:
        dun = arith.mulf(dh, pv)
        memref.store(dun, du, [e_idx])
        memref.store(dun, du_ell, [slot])
        dgn = arith.mulf(dh, uv)
      else:
        dgn = dh
      memref.store(dgn, dg, [e_idx])
      memref.store(dgn, dg_ell, [slot])
    return new_acc

  # dW_down[j] = the four warps' partials added through SMEM; thread t writes D / 128
  # contiguous elements.
  for v, col in enumerate(cols):
    vector.store(acc.results[v], scratch, [idx(warp), col])
  mgpu_utils.warpgroup_barrier()
  per_thread = d // (_WARP * _WARPS)
  vt = ir.VectorType.get((per_thread,), f32)
  t = arith.remui(tid, _c(_WARP * _WARPS, i32))
  base = idx(arith.muli(t, _c(per_thread, i32)))
  parts = [vector.load(vt, scratch, [_c(k, index), base]) for k in range(_WARPS)]
  total = arith.addf(arith.addf(parts[0], parts[1]), arith.addf(parts[2], parts[3]))
  out_ty = ir.MemRefType(dwd.type).element_type
  if out_ty != f32:
    total = arith.truncf(ir.VectorType.get((per_thread,), out_ty), total)
  vector.store(total, dwd, [idx(j), base])

