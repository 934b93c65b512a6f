"""Training (forward + backward) of the sparse ReLU FFN with Pallas Mosaic GPU kernels.

Entry points, ready for ``jax.custom_vjp`` (the static ``HybridConfig`` as its nondiff
argument):
    (y, stats), residuals = forward(cfg, x, w_gate, w_up, w_down, interpret=...)
    dx, dw_gate, dw_up, dw_down = backward(cfg, residuals, (dy, stats_cotangent), interpret=...)
``stats`` is the dict of ``ffn_mgpu.ffn_forward`` (l1, nnz_per_token, max_tile_nnz,
overflow_rows, feature_counts); only l1 is differentiable.

Forward:
 0. The first K = ``HybridConfig.hot_features`` hidden features (the hottest, once the
    features are sorted by popularity) as dense XLA GEMMs on the ELL rows; their products
    start step 3's sums, and the backward does the same for them.
 1. gate GEMM of the other features with the TwELL packing epilogue (``gate_pack_mgpu``,
    wgmma): the dense [M, H] gate never reaches HBM. K reaches the kernel as a run-time
    value, and every kernel call is jitted: layers that differ only in K share all their
    compiled kernels (a step with a new K compiles XLA's part again, not the kernels).
 2. TwELL -> hybrid layout (XLA glue on the packed [M, T*S] words): rows with at most W actives
    and no overflowing tile become ELL rows (columns, gate values; [M, W]); the other rows are
    "heavy" and go to a dense tail of static capacity R.
 3. ``ell_up_down_mgpu.ell_up_down``: sampled up projection (u on the pattern, saved), h = p * u,
    sparse down projection y, per-row L1.
 4. Tail rows (<= R): small dense XLA products on those rows, in the smallest static bucket
    that holds them. More than R heavy rows, or non-finite weights: the dense FFN
    instead (exact; reported in ``heavy_rows``). Bucket and fallback are one ``lax.switch``,
    after the sparse kernels.
Residuals: x, the weights, ELL columns / gate / up values ([M, W]), row counts, entries per
hidden column ([H], from the scatter that also gives the feature counts), the hot features'
gate / up GEMM output ([M, 2K]) and the rows it covers, the tail index and tail gate / up rows
([R, H]); never a dense [M, H] tensor.

Backward:
 1. CSC of the pattern by a stable XLA sort of the [M * W] ELL entries by column (padding
    slots get the key H and sort last); column pointers from the forward's column counts.
 2. ``sparse_backward_mgpu.csc_down_dh`` (default, ``dh_in_columns``): per column j, with
    W_down[j] in registers, gathers the dy row of each entry once for both dh (+ the L1 term)
    -> du, dg and dW_down[j] (du, dg written in both CSC and ELL order; long columns cut in
    pieces of a few hundred entries, ``column_pieces``); then ``column_sums``:
    dW_up, dW_gate from x rows; then ``ell_dx`` gathers W_up^T / W_gate^T rows for dx.
    (``dh_in_columns=False``: ``ell_dh`` computes dh row-side, gathering W_down rows, then
    ``column_sums`` gives dW_down from dy rows.) No atomics. The hot features: dense GEMMs.
 3. Tail rows: dense XLA products on the forward's bucket of rows; capacity exceeded, or a NaN
    or infinity in the weights, dy or the L1 cotangent (which the dense VJP spreads through
    the zeros of h): the VJP of the dense FFN, recomputed from x. Again one ``lax.switch``,
    after the sparse kernels.
Static shapes throughout, no value leaves the device for the program's sake: each direction
has exactly one conditional; the sparse kernels run unconditionally and, in the rare batch that
takes the dense branch, their results are dropped.
Shapes: any M, D, H (padded internally: M to 128, D to 128, H to 256 with zeros, which is exact).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jax import lax
import jax.numpy as jnp

from pallas_kernels import _common as common
from pallas_kernels import _row_loops as row_loops
from pallas_kernels import ell_up_down_mgpu
from pallas_kernels import gate_pack_mgpu
from pallas_kernels import reference
from pallas_kernels import sparse_backward_mgpu

_F32 = jnp.float32


_Gather = row_loops.GatherConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig:
  """Static configuration of one training FFN call: its shape, the hybrid layout's capacities
  and the tuned kernel choices (hashable: the custom_vjp's nondiff argument).

  Tuned on an H100 at the paper shape: ``dh_in_columns`` (dh from the column pass, one W_down
  row gather per entry less: 0.298 + 0.301 ms -> 0.480 ms); the row kernels at group 1 with
  their rows loaded a step ahead (-0.019 ms up_down, -0.008 ms dx; group 2 without rows ahead
  was 0.027 ms slower); the column kernels at group 1 without rows ahead (+0.04 ms with).
  """
  m: int
  d: int
  h: int
  ell_width: int          # W (ELL slots per row); rows with more actives are heavy
  tail_rows: int          # R, static capacity of the dense tail
  gate: gate_pack_mgpu.GateConfig = gate_pack_mgpu.GateConfig()
  # K (a multiple of 256): the first K hidden features run as small dense GEMMs on the tensor
  # cores instead of through the gather kernels, forward and backward (0: none). It pays for
  # the features that fire on more than about 1% of the tokens, which sorting the features by
  # popularity puts first (see ``ffn_mgpu.ForwardConfig.hot_features``).
  hot_features: int = 0
  dh_in_columns: bool = True
  up_down: row_loops.GatherConfig = _Gather(rows_ahead=True)
  down_dh: row_loops.GatherConfig = _Gather()
  wgrads: row_loops.GatherConfig = _Gather()
  dh: row_loops.GatherConfig = _Gather()       # the row-side dh (dh_in_columns=False)
  dx: row_loops.GatherConfig = _Gather(rows_ahead=True)
  # How the column kernels cut long columns (``sparse_backward_mgpu.PieceConfig``).
  column_pieces: sparse_backward_mgpu.PieceConfig = sparse_backward_mgpu.PieceConfig()

  def __post_init__(self):
    if min(self.m, self.d, self.h, self.ell_width, self.tail_rows) < 1:
      raise ValueError(f"HybridConfig: every size must be >= 1; got {self}")
    if self.hot_features < 0 or self.hot_features % common.TILE_N:
      raise ValueError(f"HybridConfig: hot_features must be a multiple of {common.TILE_N}, "
                       f">= 0; got {self.hot_features}")

  @property
  def mp(self) -> int:
    return common.round_up(self.m, gate_pack_mgpu.CTA_M)

  @property
  def dp(self) -> int:
    return common.round_up(self.d, 128)

  @property
  def hp(self) -> int:
    return common.round_up(self.h, common.TILE_N)

  @property
  def k_hot(self) -> int:
    """The leading hot features (``hot_features`` capped at the padded H)."""
    return min(self.hot_features, self.hp)

  @property
  def n_tiles(self) -> int:
    """256-column tiles of the packed (cold) features."""
    return (self.hp - self.k_hot) // common.TILE_N

  @property
  def ell_group(self) -> int:
    """Slots the ELL rows are stored in whole multiples of: every row kernel's group."""
    return math.lcm(self.up_down.group, self.dx.group, self.dh.group)

  @property
  def wk(self) -> int:
    """ELL slots stored per row: W rounded up to ``ell_group``."""
    return common.round_up(self.ell_width, self.ell_group)


def hybrid_config(m: int, d: int, h: int, ell_width: int = 128, tail_rows=None,
                  **kw) -> HybridConfig:
  """The config of a call: W capped at H, R = tail_rows or M/8 (capped at M)."""
  w = max(1, min(ell_width, common.round_up(h, common.TILE_N)))
  if tail_rows is None:
    tail_rows = min(m, max(8, 8 * -(-m // 64)))   # M/8, rounded up to 8
  return HybridConfig(m=m, d=d, h=h, ell_width=w, tail_rows=max(1, min(tail_rows, m)), **kw)


def tail_buckets(cfg: HybridConfig) -> tuple[int, ...]:
  """Static tail sizes; the smallest one holding the batch's heavy rows runs (``lax.switch``).

  The dense tail products cost in proportion to the rows they process, so a batch with few
  heavy rows should not pay for the full capacity R (the reference always pays 2048 rows).
  """
  r = cfg.tail_rows
  return tuple(sorted({0, min(r, common.round_up(-(-r // 16), 8)), min(r, common.round_up(-(-r // 4), 8)), r}))


def _branch(cfg: HybridConfig, heavy_rows, nonfinite):
  """The ``lax.switch`` index over [tail(rb) for rb in tail_buckets(cfg)] + [dense]: the
  smallest bucket holding the heavy rows, or the dense branch (index len(buckets)) when they
  exceed the largest, the capacity R, or when ``nonfinite`` (a NaN or infinity that the dense
  FFN spreads to every row: see ``reference.any_nonfinite``)."""
  buckets = tail_buckets(cfg)
  index = sum((heavy_rows > s_).astype(jnp.int32) for s_ in buckets)
  return jnp.where(nonfinite, len(buckets), index)


def _padded(cfg: HybridConfig, x, w_gate, w_up, w_down):
  pad = common.pad_to
  return (pad(x, (cfg.mp, cfg.dp)), pad(w_gate, (cfg.dp, cfg.hp)), pad(w_up, (cfg.dp, cfg.hp)),
          pad(w_down, (cfg.hp, cfg.dp)))


def _dense_ffn(x, w_gate, w_up, w_down):
  """(y, l1, feature counts, most actives in one 256-column tile of a row) of
  ``reference.dense_ffn_l1``: the exact path of a batch over capacity."""
  y, l1, active = reference.dense_ffn_l1(x, w_gate, w_up, w_down)
  return y, l1, jnp.sum(active, axis=0, dtype=jnp.int32), common.tile_max(active)


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------

def slot_mask(cfg: HybridConfig, n):
  """[Mp, Wk] bool: the ELL slots k < n[r] of each row that hold an entry."""
  return jnp.arange(cfg.wk)[None, :] < n[:, None]


def _hybrid_from_twell(cfg: HybridConfig, words, counts):
  """TwELL words/counts of the cold features -> (entries [Mp, Wk] int32 (``ell_up_down``'s),
  n [Mp], heavy [Mp], cnt [T, Mp])."""
  mp = cfg.mp
  if cfg.n_tiles == 0:          # every feature is hot: an empty ELL
    return (jnp.zeros((mp, cfg.wk), jnp.int32), jnp.zeros((mp,), jnp.int32),
            jnp.zeros((mp,), bool), jnp.zeros((0, mp), jnp.int32))
  kt = cfg.k_hot // common.TILE_N   # the words hold every tile; the counts from kt on
  return ell_up_down_mgpu.ell_from_twell(
      words, counts[kt:], slots=cfg.gate.slots, width=cfg.ell_width, group=cfg.ell_group,
      first_tile=kt)


def _forward_stats(cfg: HybridConfig, cnt, p_hot, tile_top, feature_counts, heavy_rows, l1,
                   zero_i) -> dict:
  """The forward's statistics. Every row's actives are in feature_counts: the ELL rows' cold
  entries and hot ones (their dense GEMMs; padding rows have none), the heavy rows' from their
  dense tail (or the dense branch's). The tile maximum likewise: the cold tiles' true counts
  (`cnt` [T, Mp]), the ELL rows' hot tiles (`p_hot`), the branch's dense rows (`tile_top`)."""
  cnt = jnp.where((jnp.arange(cfg.mp) < cfg.m)[None, :], cnt, 0)
  nnz = jnp.sum(feature_counts, dtype=_F32) / cfg.m
  hot_top = zero_i if p_hot is None else common.tile_max(p_hot > 0)
  max_tile = jnp.maximum(jnp.maximum(jnp.max(cnt, initial=0), hot_top), tile_top)
  # Rows over the ELL width by number of hot features, from the ELL rows' hot tiles and every
  # row's cold ones: a row heavy on its cold tiles alone is heavy at every smaller K too.
  hot_tiles = (jnp.zeros((0, cfg.mp), jnp.int32) if p_hot is None else jnp.sum(
      (p_hot > 0).reshape(cfg.mp, -1, common.TILE_N), axis=2, dtype=jnp.int32).T)
  heavy_by_hot = common.heavy_rows_by_tile(jnp.concatenate([hot_tiles, cnt]), cfg.ell_width,
                                           cfg.gate.slots)
  return {"l1": l1, "nnz_per_token": nnz, "max_tile_nnz": max_tile,
          "overflow_rows": heavy_rows, "feature_counts": feature_counts,
          "heavy_rows_by_hot": heavy_by_hot}


def _cold_pattern(cfg: HybridConfig, xp, w_in, interpret):
  """The gate GEMM of the features from K on, packed (`gate_pack`), in the hybrid layout:
  (entries, n, heavy, cnt) of `_hybrid_from_twell`."""
  if cfg.n_tiles:
    # The first cold column as a run-time value: one gate kernel for every K.
    words, counts = gate_pack_mgpu.gate_pack(xp, w_in, col_start=jnp.int32(cfg.k_hot),
                                             config=cfg.gate, interpret=interpret)
  else:
    words = counts = None
  return _hybrid_from_twell(cfg, words, counts)


def forward(cfg: HybridConfig, x, w_gate, w_up, w_down, *, interpret=False):
  """Returns ((y [M, D], stats dict), residuals); ``overflow_rows`` counts the heavy rows."""
  m, dt = cfg.m, x.dtype
  gated = w_gate is not None
  xp, wg, wu, wd = _padded(cfg, x, w_gate, w_up, w_down)
  w_in = wg if gated else wu
  k = cfg.k_hot
  entries, n, heavy, cnt = _cold_pattern(cfg, xp, w_in, interpret)
  # The backward's kernels take columns and values apart: one more pass (XLA does not write
  # them beside the entries, even from the same gather).
  cols, p = ell_up_down_mgpu.split_entries(entries)
  heavy_rows = jnp.sum(heavy, dtype=jnp.int32)
  tail_index = common.first_true(heavy, cfg.tail_rows, fill=cfg.mp)
  valid = slot_mask(cfg, n)
  # ELL entries per hidden feature: the forward's feature counts and the backward's CSC column
  # pointers from one scatter (saved: Hp int32; zero for the hot features).
  col_count = _column_counts(cfg, cols, valid)
  # Outside the conditional, so that XLA can share it with the backward's (same jit).
  wu_t = wu.T if gated else None

  # The sparse part runs unconditionally (in a batch that exceeds the tail capacity its
  # results are dropped): one conditional per step direction instead of two, because XLA runs
  # every conditional from the host (the branch index is copied to it: a device -> host
  # synchronization per conditional).
  y_hot = p_hot = gu_hot = None
  feature_counts = col_count
  l1_hot = jnp.zeros((), _F32)
  if k:
    # The hot features on every row the ELL covers (the tail rows are dense over all of H);
    # their products start the ELL kernel's sums.
    y_hot, gu_hot, p_hot, h_hot = reference.dense_ffn_columns(xp, wg, wu, wd, k, ~heavy)
    l1_hot = jnp.sum(jnp.abs(h_hot.astype(_F32)))
    feature_counts = feature_counts.at[:k].add(jnp.sum(p_hot > 0, axis=0, dtype=jnp.int32))
  y_ell, u, l1_rows = ell_up_down_mgpu.ell_up_down(xp, entries, n, wu_t, wd, y_init=y_hot,
                                                   config=cfg.up_down, interpret=interpret)
  u = jnp.where(valid, u, 0).astype(dt) if gated else jnp.zeros((cfg.mp, 0), dt)
  l1_ell = jnp.sum(l1_rows) + l1_hot
  r = cfg.tail_rows
  # Tail residuals (gate rows, up rows) of a branch that has none; non-gated: no up rows.
  zp = common.zeros_varying_like((r, cfg.hp), dt, xp, w_in)
  zu = common.zeros_varying_like((r, cfg.hp if gated else 0), dt, xp, w_in)

  def tail(rb):
    def f(y, u):
      if rb == 0:
        return y[:m, :cfg.d], l1_ell / m, feature_counts[:cfg.h], zero_i, (u, zp, zu)
      idx = tail_index[:rb]
      xt = common.take_rows(xp, idx)
      gt = jnp.dot(xt, w_in, preferred_element_type=_F32)
      pt = jnp.maximum(gt, 0).astype(dt)                                 # [rb, Hp]
      if gated:
        ut = jnp.dot(xt, wu, preferred_element_type=_F32).astype(dt)
        ht = (pt.astype(_F32) * ut.astype(_F32)).astype(dt)
      else:
        ut, ht = None, pt
      yt = jnp.dot(ht, wd, preferred_element_type=_F32).astype(dt)
      y = y.at[idx].set(yt, mode="drop")
      l1 = (l1_ell + jnp.sum(jnp.abs(ht.astype(_F32)))) / m
      counts = feature_counts + jnp.sum(gt > 0, axis=0, dtype=jnp.int32)
      pad_r = lambda a: jnp.pad(a, ((0, r - rb), (0, 0)))
      return (y[:m, :cfg.d], l1, counts[:cfg.h], common.tile_max(gt > 0),
              (u, pad_r(pt), pad_r(ut) if gated else zu))
    return f

  def dense(y, u):
    del y
    y, l1, counts, tile_top = _dense_ffn(x, w_gate, w_up, w_down)
    return y.astype(dt), l1, counts, tile_top, (u, zp, zu)

  zero_i = common.zeros_varying_like((), jnp.int32, xp, w_in)
  nonfinite = reference.any_nonfinite(wg, wu, wd)
  y, l1, feature_counts, tile_top, (u, pt, ut) = lax.switch(
      _branch(cfg, heavy_rows, nonfinite), [tail(rb) for rb in tail_buckets(cfg)] + [dense],
      y_ell, u)
  stats = _forward_stats(cfg, cnt, p_hot, tile_top, feature_counts, heavy_rows, l1, zero_i)
  residuals = (x, w_gate, w_up, w_down, cols, p, u, n, col_count, tail_index, heavy_rows, pt, ut,
               gu_hot, heavy if k else None, nonfinite)
  return (y, stats), residuals


# ----------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------

def _column_counts(cfg: HybridConfig, cols, valid):
  """ELL entries per hidden column [Hp] int32 (``valid``: the slots k < n of each row)."""
  return jnp.zeros((cfg.hp,), jnp.int32).at[jnp.where(valid, cols, cfg.hp)].add(1, mode="drop")


def _csc(cfg: HybridConfig, cols, n, col_count=None):
  """Sort the ELL entries by column: (col_ptr [Hp + 1], entry ids [Mp * Wk] in column order).
  ``col_count``: the forward's ``_column_counts`` (recounted when None)."""
  valid = slot_mask(cfg, n)
  key = jnp.where(valid, cols, cfg.hp).reshape(-1)
  ids = jnp.arange(key.shape[0], dtype=jnp.int32)
  # Stable: a column's entries stay in token order (a deterministic summation order for the
  # weight gradients). 16-bit keys where H allows: a radix sort then makes 2 passes, not 4.
  sort_key = key.astype(jnp.uint16) if cfg.hp < 2**16 else key
  _, sid = lax.sort((sort_key, ids), num_keys=1, is_stable=True)
  if col_count is None:
    col_count = _column_counts(cfg, cols, valid)
  col_ptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(col_count, dtype=jnp.int32)])
  return col_ptr, sid


def _sparse_weight_grads(cfg: HybridConfig, gated: bool, xp, dyp, wd, p, u, cols, n, col_count,
                         c, interpret):
  """The sparse kernels' part of the backward (module docstring of
  ``sparse_backward_mgpu``): (dW_down, dW_up^T or None, dW_gate^T (dW_up^T when non-gated),
  du and dg per ELL entry)."""
  dt = xp.dtype
  col_ptr, sid = _csc(cfg, cols, n, col_count)
  rows_s = sid // cfg.wk
  bwd = sparse_backward_mgpu
  # One cut of the columns for every column kernel (long columns in pieces).
  pieces = bwd.column_pieces(col_ptr, sid.shape[0], cfg.column_pieces)
  if cfg.dh_in_columns:
    # Column side first: dW_down and dh -> du, dg per CSC entry (dy rows; p / u read from the
    # ELL residuals through sid), then dW_up / dW_gate (x rows). du / dg come back in CSC
    # order (for the weight gradients) and in ELL order (for the row-side dx; slots past a
    # row's n are not written, ell_dx masks them).
    dwd, du_s, dg_s, du_e, dg_e = bwd.csc_down_dh(
        dyp, wd, col_ptr, rows_s, p, u if gated else None, c, sid, (cfg.mp, cfg.wk),
        pieces=pieces, config=cfg.down_dh, out_dtype=dt, interpret=interpret)
  else:
    # Row side: dh -> du, dg on the pattern (W_down rows); dW_down from the dy rows.
    du_e, dg_e = bwd.ell_dh(dyp, cols, p, u if gated else None, n, c, wd, config=cfg.dh,
                            interpret=interpret)
    valid = slot_mask(cfg, n)
    flat = lambda a: jnp.where(valid, a, 0).reshape(-1)[sid]
    h_ell = ((p.astype(_F32) * u.astype(_F32)).astype(dt).astype(_F32) if gated
             else p.astype(_F32))
    du_s, dg_s = (flat(du_e) if gated else None), flat(dg_e)
    (dwd,) = bwd.column_sums(dyp, col_ptr, rows_s, flat(h_ell), pieces=pieces,
                             config=cfg.wgrads, out_dtype=dt, name="twell_train_wgrad_down",
                             interpret=interpret)
  if gated:
    dwu_t, dwg_t = bwd.column_sums(xp, col_ptr, rows_s, du_s, dg_s, pieces=pieces,
                                   config=cfg.wgrads, out_dtype=dt,
                                   name="twell_train_wgrads_up_gate", interpret=interpret)
  else:
    dwu_t, (dwg_t,) = None, bwd.column_sums(xp, col_ptr, rows_s, dg_s, pieces=pieces,
                                            config=cfg.wgrads, out_dtype=dt,
                                            name="twell_train_wgrad_up_ng", interpret=interpret)
  return dwd, dwu_t, dwg_t, du_e, dg_e


def _hot_weight_grads(cfg: HybridConfig, xp, dyp, wg, wu, wd, c, gu_hot, heavy, dwg_t, dwu_t,
                      dwd):
  """The hot features' backward (`_hot_backward`) written into the sparse kernels' weight
  gradients, whose hot rows they left zero (no ELL entry names a hot feature): (dx part,
  dW_gate^T, dW_up^T, dW_down)."""
  k = cfg.k_hot
  dx_hot, dw_hot, dwd_hot = _hot_backward(xp, dyp, wg, wu, wd, c, k, gu_hot, ~heavy)
  # Written in place (a dynamic_update_slice of the first k rows).
  put = lambda a, rows: lax.dynamic_update_slice(a, rows.astype(a.dtype), (0, 0))
  dwg_t = put(dwg_t, dw_hot[:k])
  if wg is not None:
    dwu_t = put(dwu_t, dw_hot[k:])
  return dx_hot, dwg_t, dwu_t, put(dwd, dwd_hot)


def backward(cfg: HybridConfig, residuals, cotangents, *, interpret=False):
  """Gradients (dx, dw_gate or None, dw_up, dw_down) from the residuals of ``forward``.

  ``cotangents`` = (dy, stats cotangent): the statistics other than l1 have no gradient.
  The sparse kernels run unconditionally; then one ``lax.switch`` adds the tail bucket's
  products or, when the forward exceeded the tail capacity, replaces everything by the dense
  VJP (see ``forward`` for why there is one conditional per direction).
  """
  dy, dl1 = cotangents[0], cotangents[1]["l1"]
  (x, w_gate, _, _, cols, p, u, n, col_count, tail_index, heavy_rows, pt, ut,
   gu_hot, heavy, nonfinite) = residuals
  m, d, h, dt, gated = cfg.m, cfg.d, cfg.h, x.dtype, w_gate is not None
  xp, wg, wu, wd = _padded(cfg, *residuals[:4])
  # The weights' transposes (rows for the dx gathers) outside the conditional, so that XLA
  # can share W_up^T with the forward's when both are in one jit.
  wu_t, wg_t = wu.T, (None if wg is None else wg.T)
  dyp = common.pad_to(dy.astype(dt), (cfg.mp, cfg.dp))
  c = (dl1.astype(_F32) / m).reshape(1)

  dwd, dwu_t, dwg_t, du_e, dg_e = _sparse_weight_grads(
      cfg, gated, xp, dyp, wd, p, u, cols, n, col_count, c, interpret)
  dx_hot = None
  if cfg.k_hot:
    dx_hot, dwg_t, dwu_t, dwd = _hot_weight_grads(cfg, xp, dyp, wg, wu, wd, c, gu_hot, heavy,
                                                  dwg_t, dwu_t, dwd)
  # The hot columns' dx products start the dx kernel's sums.
  dx = sparse_backward_mgpu.ell_dx(cols, n, du_e, dg_e, wu_t, wg_t, dx_init=dx_hot,
                                   config=cfg.dx, dx_dtype=dt, interpret=interpret)

  # The kernels write the weight gradients in the parameters' dtype (rounded once from their
  # f32 sums): no f32 [H, D] round trip through memory and no convert kernels. Dense tail rows
  # (heavy rows, at most R; the smallest static bucket that holds them) add their f32 products
  # to those rounded sums and round again: batches with heavy rows round their columns' sums
  # twice (within one ulp of the once-rounded value), batches without round once, as dense.
  w_in = wg if gated else wu
  dot = functools.partial(jnp.dot, preferred_element_type=_F32)
  crop_x = lambda a: a[:m, :d].astype(dt)
  crop_w = lambda a: a[:d, :h].astype(dt)

  def tail(rb):
    def f(dx, dwg_t, dwu_t, dwd):
      if rb == 0:
        dw_in, dw_up, dw_down = dwg_t.T, (dwu_t.T if gated else None), dwd
      else:
        idx = tail_index[:rb]
        xt, dyt = common.take_rows(xp, idx), common.take_rows(dyp, idx)
        ptr, utr = pt[:rb], (ut[:rb] if gated else None)
        ptf = ptr.astype(_F32)
        h_tail = (ptf * utr.astype(_F32)).astype(dt) if gated else ptr
        dht = dot(dyt, wd.T)
        dht = jnp.where(ptr > 0, dht + c[0] * jnp.sign(h_tail.astype(_F32)), 0)
        dgt = (dht * utr.astype(_F32) if gated else dht).astype(dt)
        dxt = dot(dgt, w_in.T)
        dw_in = dwg_t.T + dot(xt.T, dgt)
        dw_down = dwd + dot(h_tail.T, dyt)
        dw_up = None
        if gated:
          dut = (dht * ptf).astype(dt)
          dxt = dxt + dot(dut, wu.T)
          dw_up = dwu_t.T + dot(xt.T, dut)
        dx = dx.at[idx].add(dxt.astype(dx.dtype), mode="drop")
      return (crop_x(dx), crop_w(dw_in), None if dw_up is None else crop_w(dw_up),
              dw_down[:h, :d].astype(dt))
    return f

  def dense(*_):
    # More heavy rows than the tail holds: the forward took its dense path, and so does this
    # (the sparse kernels above ran on that batch's residuals; their results are dropped).
    dx, dwg, dwu, dwd = reference.dense_ffn_l1_vjp(*residuals[:4], dy, dl1)
    return (dx, dwg, dwu, dwd) if gated else (dx, dwu, None, dwd)

  # A NaN or infinity in dy or in the L1 cotangent reaches every weight gradient in the dense
  # VJP (through the zeros of h): the dense branch then, as for non-finite weights.
  nonfinite = nonfinite | reference.any_nonfinite(dy, dl1)
  dx, dw_in, dw_up, dw_down = lax.switch(_branch(cfg, heavy_rows, nonfinite),
                                         [tail(rb) for rb in tail_buckets(cfg)] + [dense],
                                         dx, dwg_t, dwu_t, dwd)
  if gated:
    return dx, dw_in, dw_up, dw_down
  return dx, None, dw_in, dw_down


def _hot_backward(xp, dyp, wg, wu, wd, c, k: int, gu, rows):
  """The first k (hot) features' backward as dense products, from the gu of
  ``reference.dense_ffn_columns`` and its rows: (dx part [Mp, Dp] x.dtype, weight-gradient
  rows [k or 2k, Dp] f32 (dW_in^T, then dW_up^T when gated), dW_down rows [k, Dp] f32)."""
  dt = xp.dtype
  dot = functools.partial(jnp.dot, preferred_element_type=_F32)
  p, h = reference.columns_p_h(gu, k, rows)
  dh = dot(dyp, reference.columns(wd, k, 0).T)                         # [Mp, k]
  dh = jnp.where(p > 0, dh + c[0] * jnp.sign(h.astype(_F32)), 0)
  if gu.shape[1] == 2 * k:
    # [dg | du] = dh * [u | p] = dh * [u | gate]: dh is 0 wherever p is not the gate value
    # (p = 0). So gu with its halves swapped, in one pass.
    mp = gu.shape[0]
    swapped = gu.reshape(mp, 2, k)[:, ::-1, :].astype(_F32)
    d_cat = (dh[:, None, :] * swapped).astype(dt).reshape(mp, 2 * k)
  else:
    d_cat = dh.astype(dt)
  dx = jnp.dot(d_cat, reference.column_weights(wg, wu, k).T)
  return dx, dot(d_cat.T, xp), dot(h.T, dyp)

