"""Training backward, sparse part (Mosaic GPU, Hopper): gather kernels over the ELL pattern
(rows) and its CSC (columns).

Per token row r and ELL entry k < n_r with column j, gate value p, (gated) up value u and
h = bf16(p * u) (non-gated: h = p), and c = d(loss)/d(l1) / M (the L1 term):
    dh_k = dy_r . W_down[j, :] + c * sign(h_k)
    gated:      du_k = dh_k * p_k ;  dg_k = dh_k * u_k
                dx_r = sum_k du_k W_up^T[j, :] + dg_k W_gate^T[j, :]
    non-gated:  dg_k = dh_k ;  dx_r = sum_k dg_k W_up^T[j, :]
Weight gradients, per hidden column j over the entries of column j in column order (CSC:
``col_ptr`` [H + 1] into entry arrays sorted by column, ``rows`` their tokens):
    dW_up^T[j] = sum_e du_e x[rows_e];  dW_gate^T[j] = sum_e dg_e x[rows_e];
    dW_down[j] = sum_e h_e dy[rows_e]

Kernels:
  * ``csc_down_dh`` (columns): dh, du, dg and dW_down in one pass: per column, W_down[j] sits
    in registers and each entry's dy row serves both the dot of dh and dW_down.
  * ``column_sums`` (columns): out_i[j] = sum_e coef_i[e] a[rows_e], e.g. dW_up^T and
    dW_gate^T from the x rows.
  * ``ell_dh`` (rows): dh -> du, dg on the row side (gathers W_down rows): the alternative to
    ``csc_down_dh`` for the dh part.
  * ``ell_dx`` (rows): dx from du / dg (gathers W_up^T / W_gate^T rows).
All: one CTA (one warpgroup, 128 threads) per row or column piece, D-long f32 accumulators
in registers (D/128 per thread), scalar GMEM reads for indices and coefficients issued one step
ahead, D-long contiguous row reads, no atomics, no tensor cores. Tuned choices per kernel:
``row_loops.GatherConfig``. Requires D % 128 == 0.

Column pieces (``column_pieces``, ``PieceConfig``): a CTA walks its entries one after another,
so one long column sets a column kernel's time. A batch's own hot features outside the K hot
ones make single columns many times a fair share long (captured activations early in a run
from initialisation: docs/performance.md), which one CTA would walk longer than the dense FFN
takes. So the column kernels walk pieces of at most L entries:
    L = max(PieceConfig.length, ceil(E / X)),  X = extra pieces (static)
CTA j < H takes column j's first piece and CTAs H .. H + X - 1 the rest of every longer column
(at most X: the pieces past each column's first are at most E / L). A column of one piece is
written by its CTA as before; the pieces of a longer column write f32 partial rows, summed per
column by an XLA segment sum and rounded once into that column's output row. Every per-entry
output (du, dg) is still written once, by the piece that holds the entry.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common as common
from pallas_kernels import _target as target
from pallas_kernels import _row_loops as row_loops

_F32 = jnp.float32


def _sign(v):
  return jnp.where(v > 0, 1.0, jnp.where(v < 0, -1.0, 0.0)).astype(_F32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PieceConfig:
  """How the column kernels cut long columns (module docstring): pieces of at least
  ``length`` entries, at most ``extra`` pieces past the columns' first (the partial rows
  hold 2 ``extra`` + 1 rows of D f32 per output)."""
  length: int = 256
  extra: int = 1024

  def __post_init__(self):
    if min(self.length, self.extra) < 1:
      raise ValueError(f"PieceConfig: length and extra must be >= 1; got {self}")


class ColumnPieces(NamedTuple):
  """The column kernels' work split (``column_pieces``), per CTA g of H + X: entries
  [start[g], end[g]) of column col[g], written to the output row col[g] (slot[g] < 0) or to
  partial row slot[g]. long_cols [X]: the column of each segment (H: none); seg [2X]: the
  segment each partial row adds to (X: none)."""
  start: jax.Array
  end: jax.Array
  col: jax.Array
  slot: jax.Array
  long_cols: jax.Array
  seg: jax.Array

  @property
  def n_extra(self) -> int:
    return self.long_cols.shape[0]


def column_pieces(col_ptr, n_entries: int, config: PieceConfig = PieceConfig()) -> ColumnPieces:
  """Cuts the columns of ``col_ptr`` [H + 1] (CSC pointers into arrays of ``n_entries``
  entries) into pieces of at most L entries (module docstring); XLA glue, O(H) work."""
  hh = col_ptr.shape[0] - 1
  x = max(1, min(config.extra, -(-n_entries // config.length)))
  i32 = jnp.int32
  col_ptr = col_ptr.astype(i32)
  length = jnp.maximum(config.length, (col_ptr[hh] + (x - 1)) // x)
  lens = col_ptr[1:] - col_ptr[:-1]
  extra = jnp.maximum(lens - 1, 0) // length          # pieces past the first
  is_long = extra > 0
  rank = jnp.cumsum(is_long, dtype=i32) - is_long     # a long column's segment
  extra_end = jnp.cumsum(extra, dtype=i32)
  extra_start = extra_end - extra
  cols = jnp.arange(hh, dtype=i32)
  # The column of extra piece xi: the last long column whose extra pieces start at or
  # before xi (their starts are distinct), by a scatter and a running max.
  xi = jnp.arange(x, dtype=i32)
  first_col = jnp.full((x,), -1, i32).at[jnp.where(is_long, extra_start, x)].set(
      cols, mode="drop")
  xcol = jnp.maximum(lax.cummax(first_col), 0)
  valid = xi < extra_end[hh - 1]
  q = xi - extra_start[xcol] + 1
  xstart = jnp.where(valid, col_ptr[xcol] + q * length, 0)
  xend = jnp.where(valid, jnp.minimum(xstart + length, col_ptr[xcol + 1]), 0)
  return ColumnPieces(
      start=jnp.concatenate([col_ptr[:-1], xstart]),
      end=jnp.concatenate([jnp.minimum(col_ptr[1:], col_ptr[:-1] + length), xend]),
      col=jnp.concatenate([cols, jnp.where(valid, xcol, 0)]),
      slot=jnp.concatenate([jnp.where(is_long, rank, -1), jnp.where(valid, x + xi, 2 * x)]),
      long_cols=jnp.full((x,), hh, i32).at[jnp.where(is_long, rank, x)].set(cols, mode="drop"),
      seg=jnp.concatenate([xi, jnp.where(valid, rank[xcol], x)]))


def _merge_pieces(out, partial, pieces: ColumnPieces):
  """``out`` with each long column's row replaced by the f32 sum of its pieces' partial rows,
  rounded once to ``out``'s dtype."""
  x = pieces.n_extra
  # The first pieces' rows (slot = segment) are added as they are; the extra pieces' by a
  # segment sum in which the unused ones (segment x: most of the X rows in most batches) fall
  # out of range and are dropped, instead of all adding into one spare row (the same D
  # addresses X times).
  sums = partial[:x] + jax.ops.segment_sum(partial[x:2 * x], pieces.seg[x:], num_segments=x,
                                           indices_are_sorted=True)
  return out.at[pieces.long_cols].set(sums.astype(out.dtype), mode="drop")


def _piece_of(start_gmem, end_gmem, col_gmem, slot_gmem):
  """(column, start, end, slot) of this CTA's piece."""
  g = lax.axis_index("g")
  return col_gmem[g], start_gmem[g], end_gmem[g], slot_gmem[g]


def _write_piece(out_gmem, partial_gmem, j, slot, acc):
  """A piece's sum: the column's output row (a column of one piece), else its partial row."""
  @pl.when(slot < 0)
  def _():
    out_gmem[j, :] = acc.astype(out_gmem.dtype)

  @pl.when(slot >= 0)
  def _():
    partial_gmem[slot, :] = acc


def _dh_kernel(dy_gmem, cols_gmem, p_gmem, u_gmem, n_gmem, c_gmem, wd_gmem,
               du_gmem, dg_gmem, *, gated: bool, group: int, dy_mode: str):
  """Row-side dh on the pattern -> du, dg (gathers W_down rows)."""
  r = lax.axis_index("r")
  n = n_gmem[r]
  c = c_gmem[0]
  dy = row_loops.hold_row(dy_gmem, r, dy_mode)
  last = cols_gmem.shape[1] - 1

  def load(gi):
    ks = row_loops.group_slots(gi, group, last)
    return ([cols_gmem[r, k] for k in ks], [p_gmem[r, k].astype(_F32) for k in ks],
            [u_gmem[r, k].astype(_F32) for k in ks] if gated else None)

  def step(gi, loaded, carry):
    js, ps, us = loaded
    ks = [gi * group + q for q in range(group)]
    wds = [wd_gmem[j, :] for j in js]
    for q in range(group):
      h = (ps[q] * us[q]).astype(jnp.bfloat16).astype(_F32) if gated else ps[q]
      dh = jnp.sum(row_loops.row_at(dy, dy_gmem, r) * wds[q].astype(_F32)) + c * _sign(h)
      dh = jnp.where(ps[q] > 0, dh, 0.0)
      if gated:
        du_gmem[r, ks[q]] = dh * ps[q]
        dg_gmem[r, ks[q]] = dh * us[q]
      else:
        dg_gmem[r, ks[q]] = dh
    return carry

  row_loops.prefetched_fori_loop((n + (group - 1)) // group, load, step, 0)


def _dx_kernel(cols_gmem, n_gmem, du_gmem, dg_gmem, wup_gmem, wg_gmem, init_gmem, dx_gmem, *,
               gated: bool, group: int, rows_ahead: bool, has_init: bool):
  """dx = sum_k du_k W_up^T[j_k] + dg_k W_gate^T[j_k] (gathers W_up^T, W_gate^T rows)."""
  r = lax.axis_index("r")
  n = n_gmem[r]
  if has_init:
    acc0 = init_gmem[r, :].astype(_F32)
  else:
    acc0 = row_loops.zeros_like_row(wup_gmem[0, :])
  last = cols_gmem.shape[1] - 1

  def load(gi):
    ks = row_loops.group_slots(gi, group, last)
    # Slots k >= n may hold anything (csc_down_dh does not write them): masked to 0.
    coef = lambda ref: [jnp.where(k < n, ref[r, k], 0.0) for k in ks]
    return [cols_gmem[r, k] for k in ks], coef(dg_gmem), coef(du_gmem) if gated else None

  def fetch(loaded):
    js = loaded[0]
    return [wup_gmem[j, :] for j in js], ([wg_gmem[j, :] for j in js] if gated else None)

  def step(gi, loaded, rows, acc):
    _, dgs, dus = loaded
    wus, wgs = rows
    for q in range(group):
      if gated:
        acc = acc + dus[q] * wus[q].astype(_F32) + dgs[q] * wgs[q].astype(_F32)
      else:
        acc = acc + dgs[q] * wus[q].astype(_F32)
    return acc

  acc = row_loops.prefetched_fori_loop((n + (group - 1)) // group, load, step, acc0,
                                    fetch=fetch, fetch_ahead=rows_ahead)
  dx_gmem[r, :] = acc.astype(dx_gmem.dtype)


@common.jit_kernel_entry(("config", "interpret"))
def ell_dh(dy, cols, p, u, n, c, w_down, *, config: row_loops.GatherConfig = row_loops.GatherConfig(),
           interpret=False):
  """(du [M, Wk] f32 or None (non-gated), dg [M, Wk] f32) on the row side: slots k >= n[r]
  are not written.

  dy [M, D] bf16; cols [M, Wk] int32 (0 in unused slots); p, u [M, Wk] bf16 (0 in unused
  slots; u None when non-gated); n [M] int32; c [1] f32 (the L1 coefficient dl1 / M);
  w_down [H, D]. Wk % config.group == 0.
  """
  m, d = dy.shape
  h, d2 = w_down.shape
  wk = cols.shape[1]
  gated = u is not None
  group = config.group
  if d != d2 or d % 128 or wk % group or p.shape != (m, wk) or (gated and u.shape != (m, wk)):
    raise ValueError(f"ell_dh: bad shapes {dy.shape=} {cols.shape=} {p.shape=} "
                     f"{w_down.shape=} {group=}")
  if not gated:
    u = jnp.zeros((8, 8), p.dtype)              # unused placeholder operand
  coef_t = jax.ShapeDtypeStruct((m, wk), _F32)
  with target.interpret_context(bool(interpret)):
    f = plgpu.kernel(
        functools.partial(_dh_kernel, gated=gated, group=group, dy_mode=config.row_mode),
        out_type=(coef_t if gated else jax.ShapeDtypeStruct((1, 1), _F32), coef_t),
        grid=(m,), grid_names=("r",), compiler_params=row_loops.gather_kernel_params(),
        interpret=target.interpret_params(interpret),
        kernel_name="twell_train_bwd_dh" + ("" if gated else "_ng"))
    du, dg = common.call_kernel(f, dy, cols, p, u, n, c.astype(_F32).reshape(1), w_down)
  return (du if gated else None), dg


def _column_loads(rows_gmem, coef_refs, start, end, gi, group: int, last, via_gmem=None):
  """Scalar loads of CSC entry group ``gi`` of a column: (token rows [group], per ref of
  ``coef_refs`` its coefficients [group] as f32, 0 past the column's end, None for a None ref;
  the indices they were read at [group]). Coefficients are read at the entry e itself, or at
  ``via_gmem[e]`` (e.g. the entry's ELL slot) when given."""
  es, valid = row_loops.column_slots(start, end, gi, group, last)
  at = es if via_gmem is None else [via_gmem[e] for e in es]
  rows = [rows_gmem[e] for e in es]
  return rows, [None if ref is None else
                [jnp.where(valid[q], ref[at[q]].astype(_F32), 0.0) for q in range(group)]
                for ref in coef_refs], at


def _cols_one_kernel(a_gmem, start_gmem, end_gmem, col_gmem, slot_gmem, rows_gmem, *refs,
                     n_out: int, group: int, rows_ahead: bool = False):
  """out_i[j] = sum_{start <= e < end} coef_i[e] a[rows_e] over this CTA's piece of column j,
  for ``n_out`` coefficient arrays sharing one gathered operand ``a`` (refs: the coefficient
  arrays, then per output its rows and its partial rows)."""
  coefs, outs = refs[:n_out], refs[n_out:]
  j, start, end, slot = _piece_of(start_gmem, end_gmem, col_gmem, slot_gmem)
  last = rows_gmem.shape[0] - 1
  acc0 = (row_loops.zeros_like_row(a_gmem[0, :]),) * n_out

  def load(gi):
    return _column_loads(rows_gmem, coefs, start, end, gi, group, last)[:2]

  def step(gi, loaded, rows, accs):
    _, cs = loaded
    accs = list(accs)
    for q in range(group):
      aq = rows[q].astype(_F32)
      for i in range(n_out):
        accs[i] = accs[i] + cs[i][q] * aq
    return tuple(accs)

  n_groups = (end - start + (group - 1)) // group
  accs = row_loops.prefetched_fori_loop(n_groups, load, step, acc0,
                                     fetch=lambda loaded: [a_gmem[mm, :] for mm in loaded[0]],
                                     fetch_ahead=rows_ahead)
  for i, acc in enumerate(accs):
    _write_piece(outs[2 * i], outs[2 * i + 1], j, slot, acc)


def _cols_down_dh_kernel(dy_gmem, wd_gmem, start_gmem, end_gmem, col_gmem, slot_gmem,
                         rows_gmem, p_gmem, u_gmem, c_gmem, ids_gmem, dwd_gmem, dwd_part_gmem,
                         du_gmem, dg_gmem, du_ell_gmem, dg_ell_gmem, *, gated: bool,
                         group: int, rows_ahead: bool):
  """Column-side dh: per piece of column j, with W_down[j] held in registers, for each CSC
  entry e (token m = rows[e], ELL slot s = ids[e], gate / up values p_e = p[s], u_e = u[s]
  read from the ELL arrays, h_e = round(p_e u_e) to their dtype; non-gated h_e = p_e)
  computes dh_e = dy[m] . W_down[j] + c sign(h_e) (0 where p_e = 0) and writes
  du_e = dh_e p_e, dg_e = dh_e u_e (non-gated: dg_e = dh_e), while accumulating
  dW_down[j] = sum_e h_e dy[m]. The dy row gathered for dW_down serves dh as well, so the row
  side needs no dh pass (which gathers a W_down row per entry). du / dg are written twice:
  at e (CSC order, for the weight-gradient pass) and at ids[e] (ELL order, for dx), so no
  scatter kernel has to put them back."""
  j, start, end, slot = _piece_of(start_gmem, end_gmem, col_gmem, slot_gmem)
  c = c_gmem[0]
  last = rows_gmem.shape[0] - 1
  wdj = wd_gmem[j, :].astype(_F32)
  acc0 = row_loops.zeros_like_row(wd_gmem[j, :])

  def load(gi):
    # p / u read at each entry's ELL slot (one step ahead, like every scalar here): no XLA
    # gather has to lay them out in CSC order. The slots are kept for the ELL-order stores.
    ms, (ps, us), slots = _column_loads(rows_gmem, (p_gmem, u_gmem if gated else None),
                                        start, end, gi, group, last, via_gmem=ids_gmem)
    return ms, slots, ps, us

  def step(gi, loaded, dy_rows, acc):
    _, slots, ps, us = loaded
    # h as the forward rounded it (ell_up_down: bf16(p u) in the residuals' dtype).
    hs = ([(ps[q] * us[q]).astype(p_gmem.dtype).astype(_F32) for q in range(group)]
          if gated else ps)
    dys = [row.astype(_F32) for row in dy_rows]
    dots = [jnp.sum(dyq * wdj) for dyq in dys]
    for q in range(group):
      e = start + gi * group + q
      dyq = dys[q]
      dh = dots[q] + c * _sign(hs[q])
      dh = jnp.where(ps[q] > 0, dh, 0.0)
      # Slots past the column's end belong to the next column (or to nothing): no store.
      @pl.when(e < end)
      def _():
        slot = slots[q]
        if gated:
          du, dg = dh * ps[q], dh * us[q]
          du_gmem[e] = du
          du_ell_gmem[slot] = du
        else:
          dg = dh
        dg_gmem[e] = dg
        dg_ell_gmem[slot] = dg
      acc = acc + hs[q] * dyq
    return acc

  n_groups = (end - start + (group - 1)) // group
  acc = row_loops.prefetched_fori_loop(n_groups, load, step, acc0,
                                    fetch=lambda loaded: [dy_gmem[mm, :] for mm in loaded[0]],
                                    fetch_ahead=rows_ahead)
  _write_piece(dwd_gmem, dwd_part_gmem, j, slot, acc)


@common.jit_kernel_entry(("ell_shape", "config", "piece_config", "out_dtype", "interpret"))
def csc_down_dh(dy, w_down, col_ptr, rows, p, u, c, ids, ell_shape, *, pieces=None,
                config: row_loops.GatherConfig = row_loops.GatherConfig(),
                piece_config: PieceConfig = PieceConfig(), out_dtype=_F32, interpret=False):
  """(dW_down [H, D] ``out_dtype``, du [E] f32 or None (non-gated), dg [E] f32, du_ell or
  None, dg_ell). dW_down is summed in f32 and rounded once to ``out_dtype`` as it is written.

  dy [M, D] bf16; w_down [H, D] bf16; col_ptr [H + 1] int32; rows [E] int32 (token of each
  CSC entry); ids [E] int32: each CSC entry's flat index in the ELL arrays of shape
  ``ell_shape`` (rows * slots >= E); p, u [``ell_shape``] the gate and up values in ELL order
  (bf16, as the forward saved them; u None when non-gated; h = p u is rounded to their dtype,
  as the forward rounded it; only slots that some CSC entry e < col_ptr[H] names are read);
  c [1] f32 (the L1 coefficient, as in ``ell_dh``). ``pieces``: ``column_pieces`` of col_ptr
  (made with ``piece_config`` when None).
  du / dg come in CSC order (entries e >= col_ptr[H] not written) and in
  ELL order (du_ell / dg_ell [ell_shape]; slots that hold no entry are NOT written: readers
  mask them, as ``ell_dx`` does). dh equals ``ell_dh``'s bit for bit (same products, same
  reduction).
  """
  m, d = dy.shape
  hh = col_ptr.shape[0] - 1
  e = rows.shape[0]
  gated = u is not None
  n_ell = ell_shape[0] * ell_shape[1]
  if (w_down.shape != (hh, d) or d % 128 or tuple(p.shape) != tuple(ell_shape)
      or (gated and u.shape != p.shape) or ids.shape != (e,) or n_ell < e):
    raise ValueError(f"csc_down_dh: bad shapes {dy.shape=} {w_down.shape=} {col_ptr.shape=} "
                     f"{rows.shape=} {p.shape=} {None if u is None else u.shape=} "
                     f"{ids.shape=} {ell_shape=}")
  if pieces is None:
    pieces = column_pieces(col_ptr, e, piece_config)
  p = p.reshape(n_ell)
  u = u.reshape(n_ell) if gated else jnp.zeros((8,), p.dtype)
  coef_t = jax.ShapeDtypeStruct((e,), _F32)
  ell_t = jax.ShapeDtypeStruct((n_ell,), _F32)
  with target.interpret_context(bool(interpret)):
    f = plgpu.kernel(
        functools.partial(_cols_down_dh_kernel, gated=gated, group=config.group,
                          rows_ahead=config.rows_ahead),
        out_type=(jax.ShapeDtypeStruct((hh, d), out_dtype), _partial_type(pieces, d),
                  coef_t if gated else jax.ShapeDtypeStruct((8,), _F32), coef_t,
                  ell_t if gated else jax.ShapeDtypeStruct((8,), _F32), ell_t),
        grid=(pieces.start.shape[0],), grid_names=("g",),
        compiler_params=row_loops.gather_kernel_params(),
        interpret=target.interpret_params(interpret),
        kernel_name="twell_train_wgrad_down_dh" if gated else "twell_train_wgrad_down_dh_ng",
    )
    dwd, dwd_part, du, dg, du_ell, dg_ell = common.call_kernel(
        f, dy, w_down, *pieces[:4], rows, p, u, c.astype(_F32).reshape(1), ids)
  dwd = _merge_pieces(dwd, dwd_part, pieces)
  return (dwd, (du if gated else None), dg,
          du_ell.reshape(ell_shape) if gated else None, dg_ell.reshape(ell_shape))


@common.jit_kernel_entry(("config", "dx_dtype", "interpret"))
def ell_dx(cols, n, du, dg, w_up_t, w_gate_t, *, dx_init=None,
           config: row_loops.GatherConfig = row_loops.GatherConfig(), dx_dtype=_F32,
           interpret=False):
  """dx [M, D] = dx_init + sum_{k < n[r]} du[r, k] W_up^T[j_k] + dg[r, k] W_gate^T[j_k] over
  the ELL entries (non-gated: du = w_gate_t = None and dx = sum_k dg[r, k] W_up^T[j_k]); slots
  k >= n[r] of du / dg are ignored, so du / dg may come from ``ell_dh`` or ``csc_down_dh``.
  ``dx_init`` [M, D] (optional) is added before the one rounding to ``dx_dtype``."""
  m, wk = cols.shape
  h, d = w_up_t.shape
  gated = w_gate_t is not None
  group = config.group
  if wk % group or dg.shape != (m, wk) or (gated and du.shape != (m, wk)) or d % 128:
    raise ValueError(f"ell_dx: bad shapes {cols.shape=} {dg.shape=} {w_up_t.shape=} {group=}")
  if not gated:
    du = jnp.zeros((1, 1), _F32)
    w_gate_t = jnp.zeros((8, 128), w_up_t.dtype)
  has_init = dx_init is not None
  if has_init and dx_init.shape != (m, d):
    raise ValueError(f"ell_dx: {dx_init.shape=} must be {(m, d)}")
  if not has_init:
    dx_init = jnp.zeros((8, 128), w_up_t.dtype)   # unused placeholder operand
  with target.interpret_context(bool(interpret)):
    f = plgpu.kernel(
        functools.partial(_dx_kernel, gated=gated, group=group, rows_ahead=config.rows_ahead,
                          has_init=has_init),
        out_type=jax.ShapeDtypeStruct((m, d), dx_dtype), grid=(m,), grid_names=("r",),
        compiler_params=row_loops.gather_kernel_params(),
        interpret=target.interpret_params(interpret),
        kernel_name="twell_train_bwd_dx" + ("" if gated else "_ng"))
    return common.call_kernel(f, cols, n, du, dg, w_up_t, w_gate_t, dx_init)


@common.jit_kernel_entry(("config", "piece_config", "out_dtype", "name", "interpret"))
def column_sums(a, col_ptr, rows, *coefs, pieces=None,
                config: row_loops.GatherConfig = row_loops.GatherConfig(),
                piece_config: PieceConfig = PieceConfig(), out_dtype=_F32,
                name: str = "twell_train_column_sums", interpret=False):
  """out_i [H, D] ``out_dtype``, out_i[j] = sum_{col_ptr[j] <= e < col_ptr[j + 1]}
  coefs[i][e] a[rows[e]] (summed in f32 in entry order, rounded once as written).

  a [M, D] bf16 (x for dW_up^T / dW_gate^T, dy for dW_down); col_ptr [H + 1] int32; rows [E]
  int32 (token of each entry, sorted by column); coefs: [E] f32 arrays in the same order.
  Several coefficient arrays share each gathered row (one gather for dW_up^T and dW_gate^T).
  ``pieces``: ``column_pieces`` of col_ptr (made with ``piece_config`` when None).
  """
  m, d = a.shape
  hh = col_ptr.shape[0] - 1
  e = rows.shape[0]
  if d % 128 or not coefs or any(c.shape != (e,) for c in coefs):
    raise ValueError(f"column_sums: bad shapes {a.shape=} {rows.shape=} "
                     f"{[c.shape for c in coefs]}")
  if pieces is None:
    pieces = column_pieces(col_ptr, e, piece_config)
  with target.interpret_context(bool(interpret)):
    f = plgpu.kernel(
        functools.partial(_cols_one_kernel, n_out=len(coefs), group=config.group,
                          rows_ahead=config.rows_ahead),
        out_type=sum(((jax.ShapeDtypeStruct((hh, d), out_dtype), _partial_type(pieces, d))
                      for _ in coefs), ()),
        grid=(pieces.start.shape[0],), grid_names=("g",),
        compiler_params=row_loops.gather_kernel_params(),
        interpret=target.interpret_params(interpret), kernel_name=name,
    )
    outs = common.call_kernel(f, a, *pieces[:4], rows, *coefs)
  return tuple(_merge_pieces(outs[2 * i], outs[2 * i + 1], pieces) for i in range(len(coefs)))


def _partial_type(pieces: ColumnPieces, d: int):
  """The partial rows of one output: 2 X rows and the one unused pieces write."""
  return jax.ShapeDtypeStruct((2 * pieces.n_extra + 1, d), _F32)
