"""Dense FFN on a device-counted list of rows (Mosaic GPU, Hopper): the inference forward's
exact path for the rows its sparse kernels cannot hold.

For i < n, with r = rows[i] (n and rows are device values):
    gated:      g = bf16(x_r @ w_gate),  u = bf16(x_r @ w_up),  h_i = bf16(relu(g) * u)
    non-gated:  g = bf16(x_r @ w_up),                           h_i = relu(g)
    y_i  = bf16(h_i @ w_down)          (every product a bf16 wgmma with f32 accumulation)
    l1_i = sum_j |h_ij| (f32);  counts_j = #{i < n : g_ij > 0}
which is ``reference.dense_ffn_hidden`` row for row (the same roundings; only the GEMMs' summation
order may differ). Outputs are compact: y [R, D], l1 [R] (entries i >= n are unspecified),
counts [H] int32.

Why device-counted: the sparse forward learns how many rows overflow only on the device. A
``lax.switch`` over static row buckets makes the host wait for that count in the middle of
every call (XLA runs conditionals from the host), which stalls a model's pipelined launches at
every layer. These kernels read n themselves: every CTA loops over the tiles of the first
ceil(n / block_m) row blocks only, so with no such row the three launches are all they cost,
and with every row (a NaN in a weight) they are a dense FFN.

Kernels (persistent grids over the SMs):
  1. gather: rows x[rows[i]] -> x_rows[i] (D-long GMEM row copies).
  2. gate / up GEMM over the row blocks (TMA pipeline, wgmma into one or two [block_m,
     block_n] accumulators), epilogue h, and per tile the l1 partial sums of its rows and the
     active counts of its columns over the rows i < n.
  3. down GEMM h @ w_down over the same row blocks.
Shapes: R % block_m == 0, D % 128 == 0 and % block_k, H % block_n and % block_k (callers pad).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common as common
from pallas_kernels import _target as target
from pallas_kernels import _row_loops as row_loops

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseRowsConfig:
  """Tiles of the two GEMMs. One warpgroup per CTA holds the accumulators: two block_m x
  block_n f32 ones for the gated gate / up GEMM, one block_m x down_block_n for the down GEMM
  (128 registers per thread either way). Each K step's wgmmas stay in flight while the next
  step's wait for their tiles (the pipeline releases a stage one step late)."""
  block_m: int = 64
  block_n: int = 128
  down_block_n: int = 256
  block_k: int = 64
  stages: int = 4

  def __post_init__(self):
    if self.block_m != 64:
      raise ValueError(f"{self.block_m=} must be 64 (one wgmma row block)")
    if (self.block_n not in (64, 128, 256) or self.down_block_n not in (64, 128, 256)
        or self.block_k not in (32, 64)):
      raise ValueError(f"{self.block_n=} and {self.down_block_n=} must be 64, 128 or 256, "
                       f"{self.block_k=} 32 or 64")
    if self.stages < 2:
      raise ValueError(f"{self.stages=} must be >= 2")


def _transforms(minor_elems: int):
  swizzle = plgpu.find_swizzle(minor_elems * 16)
  return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


def _my_tiles(n, block_m: int, grid_n: int):
  """(first tile, tile count) of this CTA's share of the first ceil(n / block_m) row blocks
  (tiles sm, sm + num_sms, ...; row-major, so the CTAs working at once share their x rows)."""
  sm, num_sms = lax.axis_index("sm"), lax.axis_size("sm")
  tiles = lax.div(n + (block_m - 1), block_m) * grid_n
  return sm, num_sms, lax.div(jnp.maximum(tiles - sm, 0) + (num_sms - 1), num_sms)


def _gather_kernel(n_gmem, rows_gmem, x_gmem, out_gmem):
  n = jnp.minimum(n_gmem[0], out_gmem.shape[0])
  sm, num_sms, count = _my_tiles(n, 1, 1)     # one row per "tile"

  @pl.loop(0, count)
  def _(t):
    i = sm + t * num_sms
    out_gmem[i, :] = x_gmem[rows_gmem[i], :]


def _gemm_kernel(n_gmem, a_gmem, *refs, n_b: int, bn: int, epilogue, cfg: DenseRowsConfig):
  """Shared body: for each of this CTA's tiles (mi, ni), acc_q = a[mi] @ b_q[:, ni] for the
  n_b weights b_q ([block_m, bn] tiles), then ``epilogue(mi, ni, n, accs, outs, scratch)``."""
  b_gmems, rest = refs[:n_b], refs[n_b:]
  bm, bk = cfg.block_m, cfg.block_k
  k = a_gmem.shape[1]
  grid_n = b_gmems[0].shape[1] // bn
  n = jnp.minimum(n_gmem[0], a_gmem.shape[0])
  sm, num_sms, count = _my_tiles(n, bm, grid_n)
  a_tr, b_tr = _transforms(bk), _transforms(bn)

  @pl.loop(0, count)
  def _tile(t):
    lin = sm + t * num_sms
    mi, ni = lax.div(lin, grid_n), lax.rem(lin, grid_n)

    def acc_scope(*accs):
      def body(_, a_smem, *b_smems):
        for acc, b_smem in zip(accs, b_smems):
          plgpu.wgmma(acc, a_smem, b_smem)
        # This step's n_b wgmma groups stay in flight; the step before's are done, and the
        # pipeline (delay_release=1) refills that step's stage after this body.
        plgpu.wgmma_wait(n_b)

      plgpu.emit_pipeline(
          body,
          grid=(k // bk,),
          in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (mi, kk), transforms=a_tr,
                                    delay_release=1)]
          + [plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), transforms=b_tr,
                             delay_release=1)] * n_b,
          max_concurrent_steps=cfg.stages,
      )(a_gmem, *b_gmems)
      plgpu.wgmma_wait(0)
      return tuple(acc[...] for acc in accs)

    accs = pl.run_scoped(acc_scope, *[plgpu.ACC((bm, bn), _F32)] * n_b)
    epilogue(mi, ni, n, accs, rest)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gate_up_epilogue(mi, ni, n, accs, refs, *, cfg: DenseRowsConfig):
  h_gmem, l1_gmem, cnt_gmem, h_smem, l1_smem, cnt_smem = refs
  bm, bn = cfg.block_m, cfg.block_n
  g = accs[0].astype(jnp.bfloat16).astype(_F32)
  relu = jnp.maximum(g, 0.0)               # NaN stays NaN, as in XLA's max
  if len(accs) == 2:
    h = (relu * accs[1].astype(jnp.bfloat16).astype(_F32)).astype(jnp.bfloat16)
  else:
    h = relu.astype(jnp.bfloat16)
  row = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bm, bn), 0),
                          plgpu.Layout.WGMMA) + mi * bm
  active = jnp.where(jnp.logical_and(g > 0, row < n), 1, 0)
  l1 = jnp.sum(jnp.abs(h.astype(_F32)), axis=1)           # [bm]
  cnt = jnp.sum(active, axis=0)                            # [bn]
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)          # the last tile's stores read these
  h_smem[...] = h
  l1_smem[...] = l1
  cnt_smem[...] = cnt
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(h_smem, h_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)],
                          commit_group=False)
  plgpu.copy_smem_to_gmem(l1_smem, l1_gmem.at[ni, pl.ds(mi * bm, bm)], commit_group=False)
  plgpu.copy_smem_to_gmem(cnt_smem, cnt_gmem.at[mi, pl.ds(ni * bn, bn)], commit_group=False)
  plgpu.commit_smem_to_gmem_group()


def _down_epilogue(mi, ni, n, accs, refs, *, cfg: DenseRowsConfig):
  del n
  y_gmem, y_smem = refs
  bm, bn = cfg.block_m, cfg.down_block_n
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  y_smem[...] = accs[0].astype(y_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])


def dense_ffn_rows(x, rows, n, w_gate, w_up, w_down, *,
                   config: DenseRowsConfig = DenseRowsConfig(), interpret=False):
  """(y [R, D] bf16, l1 [R] f32, counts [H] int32) of the dense FFN on rows x[rows[i]], i < n.

  x [M, D] bf16; rows [R] int32, rows[i] in [0, M) for i < n (entries i >= n unused, any
  value); n: the row count, an int32 scalar or the first element of an int32 array (read on
  the device as it is: no XLA op in between), at most R counted;
  w_gate (None: non-gated) / w_up [D, H], w_down [H, D] bf16. Needs R % 64 == 0,
  D % 128 == 0, H % block_n == 0 (the caller pads)."""
  cfg = config
  d = x.shape[1]
  (r,) = rows.shape
  h = w_up.shape[1]
  gated = w_gate is not None
  if r % cfg.block_m or d % 128 or d % cfg.block_k or h % cfg.block_n or h % cfg.block_k:
    raise ValueError(f"dense_ffn_rows: bad shapes {x.shape=} {rows.shape=} {w_up.shape=} "
                     f"for {cfg}")
  if w_down.shape != (h, d) or (gated and w_gate.shape != (d, h)):
    raise ValueError(f"dense_ffn_rows: {w_down.shape=} must be {(h, d)}"
                     + (f", {w_gate.shape=} {(d, h)}" if gated else ""))
  n = jnp.asarray(n, jnp.int32)
  n = jnp.reshape(n, (1,)) if n.ndim == 0 else n
  bm, bn = cfg.block_m, cfg.block_n
  grid = dict(grid=(target.num_sms(),), grid_names=("sm",),
              interpret=target.interpret_params(interpret))
  lane = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
  with target.interpret_context(bool(interpret)):
    gather = plgpu.kernel(
        _gather_kernel, out_type=jax.ShapeDtypeStruct((r, d), x.dtype),
        compiler_params=row_loops.gather_kernel_params(), kernel_name="twell_dense_rows_gather",
        **grid)
    x_rows = common.call_kernel(gather, n, rows, x)

    tr = _transforms(bn)
    gate_up = plgpu.kernel(
        functools.partial(_gemm_kernel, n_b=2 if gated else 1, bn=bn, cfg=cfg,
                          epilogue=functools.partial(_gate_up_epilogue, cfg=cfg)),
        out_type=(jax.ShapeDtypeStruct((r, h), jnp.bfloat16),
                  jax.ShapeDtypeStruct((h // bn, r), _F32),
                  jax.ShapeDtypeStruct((r // bm, h), jnp.int32)),
        scratch_types=(plgpu.SMEM((bm, bn), jnp.bfloat16, transforms=tr),
                       plgpu.SMEM((bm,), _F32), plgpu.SMEM((bn,), jnp.int32)),
        compiler_params=lane, kernel_name="twell_dense_rows_gate_up", **grid)
    ws = (w_gate, w_up) if gated else (w_up,)
    h_rows, l1_part, cnt_part = common.call_kernel(gate_up, n, x_rows, *ws)

    dbn = cfg.down_block_n
    while d % dbn:     # D is a multiple of 128, not always of 256
      dbn //= 2
    dcfg = dataclasses.replace(cfg, down_block_n=dbn)
    down = plgpu.kernel(
        functools.partial(_gemm_kernel, n_b=1, bn=dbn, cfg=dcfg,
                          epilogue=functools.partial(_down_epilogue, cfg=dcfg)),
        out_type=jax.ShapeDtypeStruct((r, d), x.dtype),
        scratch_types=(plgpu.SMEM((bm, dbn), x.dtype, transforms=_transforms(dbn)),),
        compiler_params=lane, kernel_name="twell_dense_rows_down", **grid)
    y_rows = common.call_kernel(down, n, h_rows, w_down)

  # Partials of row blocks past n were never written: mask them before summing.
  blocks = jnp.arange(r // bm)[:, None] < lax.div(jnp.minimum(n[0], r) + (bm - 1), bm)
  counts = jnp.sum(jnp.where(blocks, cnt_part, 0), axis=0, dtype=jnp.int32)
  l1 = jnp.sum(l1_part, axis=0)
  return y_rows, l1, counts
