"""Fused sparse up / down projection over ELL rows (Mosaic GPU, Hopper): ``ell_up_down``,
the sampled up projection and the sparse down projection, the sparse part of both the
inference forward (``ffn_mgpu``) and the training forward (``ffn_train_mgpu``, which also
keeps the up values as a residual for the backward).

Per token row r with ELL entries k < n_r (entries[r, k] = j << 16 | bf16 bits of p: column j,
gate value p > 0):
    gated:      u_k = bf16(x_r . W_up^T[j])     (f32 dot, rounded like XLA's bf16 GEMM output)
                h_k = bf16(p_k * u_k)
    non-gated:  h_k = p_k                        (p is relu(x W_up) itself; no u)
    y_r  = bf16(y_init_r + sum_k h_k * W_down[j, :])   (f32 accumulation)
    l1_r = sum_k |h_k|                           (f32)
Outputs: y [M, D] bf16, u [M, Wk] f32 (gated, ``write_u``; slots k >= n_r hold garbage: the
caller masks), l1 [M] f32. Rows with n_r == 0 (empty rows, and rows the caller computes on a
dense path) get y = y_init and l1 = 0.
``ell_from_twell`` (XLA; training) and ``twell_to_ell_triton.twell_to_ell`` (one kernel; the
inference forward) turn the gate kernel's TwELL tiles into these rows.

Mapping: one CTA (one warpgroup, 128 threads) per row; x_r and the f32 accumulator live in
registers (D/128 values per thread), ELL entries are scalar GMEM reads (one per entry) issued
one step ahead (``row_loops.prefetched_fori_loop``), and weight rows are D-long contiguous GMEM
(L2) reads of ``w_up_t`` [H, D] and ``w_down`` [H, D]. ``group`` entries are processed side
by side per step, so 2 * group row loads are in flight (twice that with ``rows_ahead``, which
issues the next step's rows before this step's work); slots past n_r hold 0 (column 0, p = 0;
the caller pads the ELL arrays to a multiple of ``group`` slots).
No tensor cores. Requires D % 128 == 0.
"""

from __future__ import annotations

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


def _kernel(x_gmem, entries_gmem, n_gmem, wup_gmem, wd_gmem, init_gmem, pos_gmem,
            yd_gmem, l1d_gmem, y_gmem, u_gmem, l1_gmem, *, gated: bool, group: int,
            x_mode: str, rows_ahead: bool, has_init: bool, write_u: bool, has_dense: bool):
  r = lax.axis_index("r")
  n = n_gmem[r]
  x = row_loops.hold_row(x_gmem, r, x_mode) if gated else None
  if has_init:
    acc0 = init_gmem[r, :].astype(_F32)
  else:
    acc0 = row_loops.zeros_like_row(wd_gmem[0, :])

  last = entries_gmem.shape[1] - 1

  def load(gi):
    # One scalar per entry: the column is its high half, p its low half (bf16 bits, which
    # shifted up are the f32 value).
    es = [entries_gmem[r, k] for k in row_loops.group_slots(gi, group, last)]
    return ([lax.shift_right_logical(e, 16) for e in es],
            [lax.bitcast_convert_type(lax.shift_left(e, 16), _F32) for e in es])

  def fetch(loaded):
    js = loaded[0]
    return [wd_gmem[j, :] for j in js], ([wup_gmem[j, :] for j in js] if gated else None)

  def step(gi, loaded, rows, carry):
    acc, l1 = carry
    _, ps = loaded
    wds, wus = rows
    ks = [gi * group + q for q in range(group)]
    for q in range(group):
      if gated:
        u = jnp.sum(row_loops.row_at(x, x_gmem, r) * wus[q].astype(_F32))
        u = u.astype(jnp.bfloat16).astype(_F32)
        if write_u:
          u_gmem[r, ks[q]] = u
        h = (ps[q] * u).astype(jnp.bfloat16).astype(_F32)
      else:
        h = ps[q]
      acc = acc + h * wds[q].astype(_F32)
      l1 = l1 + jnp.abs(h)
    return acc, l1

  n_groups = (n + (group - 1)) // group
  acc, l1 = row_loops.prefetched_fori_loop(n_groups, load, step, (acc0, jnp.float32(0.0)),
                                        fetch=fetch, fetch_ahead=rows_ahead)
  if not has_dense:
    y_gmem[r, :] = acc.astype(y_gmem.dtype)
    l1_gmem[r] = l1
    return
  pos = pos_gmem[r]

  @pl.when(pos < 0)
  def _sparse():
    y_gmem[r, :] = acc.astype(y_gmem.dtype)
    l1_gmem[r] = l1

  @pl.when(pos >= 0)
  def _dense():
    y_gmem[r, :] = yd_gmem[pos, :]
    l1_gmem[r] = l1d_gmem[pos]


@common.jit_kernel_entry(("write_u", "config", "interpret"))
def ell_up_down(x, entries, n, w_up_t, w_down, *, y_init=None, dense=None,
                write_u: bool = True, config: row_loops.GatherConfig = row_loops.GatherConfig(),
                interpret=False):
  """(y [M, D] bf16, u [M, Wk] f32, l1 [M] f32); ``w_up_t`` is None for non-gated blocks,
  u is None for them and without ``write_u`` (the inference forward keeps no residuals).

  x [M, D] bf16; entries [M, Wk] int32 (``ell_from_twell``: col << 16 | bf16 bits of p, 0 in
  unused slots); n [M] int32 entries per row; w_up_t, w_down [H, D] bf16. Wk % config.group == 0,
  D % 128 == 0. With ``config.rows_ahead`` the weight rows are in flight while the step before
  stores its u values. ``y_init`` [M, D]: added to each row's sum before it is rounded (one
  rounding for y = y_init + the sparse products).
  ``dense`` = (pos [M] int32, y_dense [R, D] bf16, l1_dense [R] f32): rows with pos_r >= 0
  (which must have n_r == 0) take y_dense[pos_r] and l1_dense[pos_r] instead of their sums
  (rows another kernel computed densely, ``dense_rows_mgpu``).
  """
  m, d = x.shape
  h, d2 = w_down.shape
  wk = entries.shape[1]
  gated = w_up_t is not None
  group = config.group
  if d != d2 or d % 128 or wk % group or entries.shape != (m, wk):
    raise ValueError(f"ell_up_down: bad shapes {x.shape=} {entries.shape=} "
                     f"{w_down.shape=} {group=}")
  if gated and w_up_t.shape != (h, d):
    raise ValueError(f"ell_up_down: {w_up_t.shape=} must be {(h, d)}")
  # Operands a variant does not read are stood in for by ones at hand (a fresh zeros array
  # would cost a kernel launch per call).
  if not gated:
    w_up_t = w_down
  has_init = y_init is not None
  if has_init and y_init.shape != (m, d):
    raise ValueError(f"ell_up_down: {y_init.shape=} must be {(m, d)}")
  if not has_init:
    y_init = x
  has_dense = dense is not None
  if has_dense:
    pos, y_dense, l1_dense = dense
    if pos.shape != (m,) or y_dense.shape[1:] != (d,) or l1_dense.shape != y_dense.shape[:1]:
      raise ValueError(f"ell_up_down: dense rows {pos.shape=} {y_dense.shape=} "
                       f"{l1_dense.shape=} must be [M={m}], [R, D={d}], [R]")
  else:
    pos, y_dense, l1_dense = n, x, n
  with target.interpret_context(bool(interpret)):
    f = plgpu.kernel(
        functools.partial(_kernel, gated=gated, group=group, x_mode=config.row_mode,
                          rows_ahead=config.rows_ahead, has_init=has_init,
                          write_u=write_u and gated, has_dense=has_dense),
        out_type=(jax.ShapeDtypeStruct((m, d), x.dtype),
                  jax.ShapeDtypeStruct((m, wk) if gated and write_u else (8, 128), _F32),
                  jax.ShapeDtypeStruct((m,), _F32)),
        grid=(m,),
        grid_names=("r",),
        compiler_params=row_loops.gather_kernel_params(),
        interpret=target.interpret_params(interpret),
        kernel_name="twell_up_down" if gated else "twell_down",
    )
    y, u, l1 = common.call_kernel(f, x, entries, n, w_up_t, w_down, y_init, pos, y_dense,
                                  l1_dense)
  return y, (u if gated and write_u else None), l1


def ell_from_twell(words, counts, *, slots: int, width: int, group: int = 1,
                   first_tile: int = 0):
  """TwELL (``gate_pack_mgpu.gate_pack``'s words [M, T*S] / counts [T, M]) -> this kernel's
  ELL rows: (entries [M, Wk] int32, the row's packed words (col << 16 | bf16 bits of p, col a
  hidden feature index) in column order, 0 in unused slots; Wk: ``width`` rounded up to whole
  ``group``s of slots, the kernel's ``GatherConfig.group``), n [M] int32 entries per row,
  over [M] bool, counts [T, M] int32 true tile counts, as given). Rows with more than
  ``width`` entries or a tile holding more than ``slots`` (its packed slots lost entries)
  are ``over``: they get n = 0 and the caller computes them on a dense path. XLA glue: a sum
  over the row's tiles gives each slot's word, a gather reads it. The counts stay in their
  [T, M] layout (a transpose would cost a pass of its own). ``first_tile``: ``counts`` are
  those of the words' tiles from this one on (the words of a run-time ``col_start``, whose
  tiles before it the caller leaves out).
  """
  t = words.shape[1] // slots
  # One reduction for both tests: a tile over S adds more than the width, so its row is over.
  total = jnp.sum(jnp.where(counts > slots, counts + width + 1, counts), axis=0)   # [M]
  over = total > width
  n = jnp.where(over, 0, total).astype(jnp.int32)
  kept = jnp.minimum(counts, slots)
  incl = jnp.cumsum(kept, axis=0)                                           # [T, M]
  # Slot k of a row lies in tile t* = #{t : incl_t <= k}, at word t* S + k - incl_{t*-1}
  # = k + sum over those tiles of (S - kept_t): one reduction over the tiles, then a gather.
  # (The tiles unrolled into elementwise ops instead measured no faster in the inference
  # forward, and in training XLA fused them into a reduction that recomputed them per use:
  # 0.127 ms.)
  k = jnp.arange(width, dtype=jnp.int32)
  skipped = jnp.where(incl[:, :, None] <= k[None, None, :], slots - kept[:, :, None], 0)
  idx = jnp.minimum(k[None, :] + first_tile * slots + jnp.sum(skipped, axis=0, dtype=jnp.int32),
                    t * slots - 1)
  valid = k[None, :] < n[:, None]
  # Unused slots read the row's first word: one sector for all of them, not one each.
  entries = jnp.where(valid, jnp.take_along_axis(words, jnp.where(valid, idx, 0), axis=1), 0)
  if (wk := common.round_up(width, group)) > width:
    entries = jnp.pad(entries, ((0, 0), (0, wk - width)))
  return entries, n, over, counts


def split_entries(entries):
  """ELL entries -> (cols int32 hidden feature indices, p bf16 values); 0 and 0 in unused
  slots."""
  cols = lax.shift_right_logical(entries, 16)
  p = lax.bitcast_convert_type((entries & 0xFFFF).astype(jnp.uint16), jnp.bfloat16)
  return cols, p
