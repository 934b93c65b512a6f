"""Fused sparse up/down projection over a TwELL-packed gate (Mosaic GPU, Hopper).

Gated (``gated=True``), per token row r with packed gate entries (j, g_j), g_j = relu(x W_gate)_j:
    u_j = bf16(x_r . W_up[:, j])          (f32 dot, rounded like XLA's bf16 GEMM output)
    h_j = bf16(g_j * u_j)
    y_r = bf16(sum_j h_j * W_down[j, :])  (f32 accumulation)
Non-gated (``gated=False``): the packed entries are h_j = relu(x W_up)_j themselves and
    y_r = bf16(sum_j h_j * W_down[j, :]).
Also returns l1_r = sum_j |h_j| (f32) per row. h is never written to HBM.

Weight layouts: the up weight is passed transposed, ``w_up_t`` [H, D], and the down weight as
is, [H, D]: both gathers read one contiguous D-long row per active feature.

Mapping: one CTA (one warpgroup, 128 threads) per ``rows_per_cta`` token rows; a row's x and
its f32 accumulator live in registers (D/128 values per thread each), the packed words and
counts are read as scalars straight from GMEM, weight rows are loaded from GMEM (L2) into
registers with 16-byte vector loads. Rows flagged in ``row_ok`` == 0 (overflow rows: some tile
holds more than S entries) are skipped; the caller computes them on another path.
No tensor cores: each active entry costs 2 D-long row reads and ~4D FMAs. The default kernel
(``prefetch=True``, ``_kernel_prefetch``) issues the scalar index loads one step ahead; the
v1 kernel (``prefetch=False``) walks ``group`` tiles side by side. PERF.md has the numbers.
Requires D % 128 == 0 (the caller pads).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common


def _row_start(x_gmem, wd_gmem, r, gated: bool, x_mode: str = "f32"):
  """(x_r held per ``x_mode`` (``common.hold_row``) or None when non-gated, a zero f32 [D]
  accumulator)."""
  acc0 = common.zeros_like_row(wd_gmem[0, :])
  if not gated:
    return None, acc0
  return common.hold_row(x_gmem, r, x_mode), acc0


def _decode(t, w):
  """Packed word of tile t -> (hidden column j, value as f32)."""
  j = t * common.TILE_N + lax.shift_right_logical(w, 16)
  return j, lax.bitcast_convert_type(lax.shift_left(w, 16), jnp.float32)


def _sampled_h(x, x_gmem, r, wup_gmem, j, g):
  """h_j = bf16(g_j * bf16(x_r . W_up[:, j])) as f32 (x_r held per ``common.hold_row``)."""
  u = jnp.sum(common.row_at(x, x_gmem, r) * wup_gmem[j, :].astype(jnp.float32))
  u = u.astype(jnp.bfloat16).astype(jnp.float32)
  return (g * u).astype(jnp.bfloat16).astype(jnp.float32)


def _kernel(x_gmem, words_gmem, counts_gmem, rowok_gmem, wup_gmem, wd_gmem,
            y_gmem, l1_gmem, *, rows_per_cta: int, slots: int, n_tiles: int, gated: bool,
            group: int):
  base = lax.axis_index("r") * rows_per_cta
  n_groups = -(-n_tiles // group)

  def row_body(i, _):
    r = base + i
    ok = rowok_gmem[r]
    x, acc0 = _row_start(x_gmem, wd_gmem, r, gated)

    # `group` tiles are walked side by side: entry k of each of them is processed in the same
    # step, so 2 * group weight-row loads are in flight before the first reduction. Slots past
    # a tile's count point at weight row 0 (an L1 hit) with a zero coefficient.
    def group_body(gi, carry):
      tiles = [jnp.minimum(gi * group + p, n_tiles - 1) for p in range(group)]
      cnts = []
      for p in range(group):
        c = jnp.minimum(counts_gmem[r, tiles[p] * common.COUNT_LANES], slots)
        c = jnp.where((ok != 0) & (gi * group + p < n_tiles), c, 0)
        cnts.append(c)
      n = cnts[0]
      for c in cnts[1:]:
        n = jnp.maximum(n, c)

      def entry_body(k, carry):
        acc, l1 = carry
        js, gs = [], []
        for p in range(group):
          valid = k < cnts[p]
          w = words_gmem[r, tiles[p] * slots + jnp.minimum(k, slots - 1)]
          j, g = _decode(tiles[p], w)
          js.append(jnp.where(valid, j, 0))
          gs.append(jnp.where(valid, g, 0.0))
        wds = [wd_gmem[j, :] for j in js]
        if gated:
          wus = [wup_gmem[j, :] for j in js]
        for p in range(group):
          if gated:
            u = jnp.sum(x * wus[p].astype(jnp.float32))
            u = u.astype(jnp.bfloat16).astype(jnp.float32)
            h = (gs[p] * u).astype(jnp.bfloat16).astype(jnp.float32)
          else:
            h = gs[p]
          acc = acc + h * wds[p].astype(jnp.float32)
          l1 = l1 + jnp.abs(h)
        return acc, l1

      return lax.fori_loop(0, n, entry_body, carry)

    acc, l1 = lax.fori_loop(0, n_groups, group_body, (acc0, jnp.float32(0.0)))
    y_gmem[r, :] = acc.astype(y_gmem.dtype)
    l1_gmem[r] = l1
    return 0

  lax.fori_loop(0, rows_per_cta, row_body, 0)


def _walk_entries(words_gmem, counts_gmem, r, ok, *, slots: int, n_tiles: int, entry, init):
  """Folds ``entry(t, k, w, state) -> state`` over the valid packed entries of row r (none
  unless ``ok``), tile by tile, with the scalar index loads software-pipelined.

  The per-entry chain of a plain walk is count load -> word load -> weight-row loads ->
  reduction, all L2 round trips in a row. Here the next tile's count and first word are loaded
  while the current tile's entries run, and inside a tile the next entry's word is loaded
  before ``entry`` issues the current entry's weight rows.
  """
  last_tile = n_tiles - 1

  def count(t):
    return jnp.where(ok, jnp.minimum(counts_gmem[r, t * common.COUNT_LANES], slots), 0)

  def tile_body(t, carry):
    state, cnt, w0 = carry
    t_next = jnp.minimum(t + 1, last_tile)
    cnt_next = jnp.where(t < last_tile, count(t_next), 0)
    w0_next = words_gmem[r, t_next * slots]

    def entry_body(k, carry):
      state, w = carry
      w_next = words_gmem[r, t * slots + jnp.minimum(k + 1, slots - 1)]
      return entry(t, k, w, state), w_next

    state, _ = lax.fori_loop(0, cnt, entry_body, (state, w0))
    return state, cnt_next, w0_next

  state, _, _ = lax.fori_loop(0, n_tiles, tile_body, (init, count(0), words_gmem[r, 0]))
  return state


def _kernel_prefetch(x_gmem, words_gmem, counts_gmem, rowok_gmem, wup_gmem, wd_gmem,
                     y_gmem, l1_gmem, *, rows_per_cta: int, slots: int, n_tiles: int,
                     gated: bool, x_mode: str = "f32"):
  """Same math as ``_kernel`` (group=1), with the index loads software-pipelined
  (``_walk_entries``), so only the weight-row loads and the reduction stay on the chain."""
  base = lax.axis_index("r") * rows_per_cta

  def row_body(i, _):
    r = base + i
    x, acc0 = _row_start(x_gmem, wd_gmem, r, gated, x_mode)

    def entry(t, k, w, state):
      del k
      acc, l1 = state
      j, g = _decode(t, w)
      wd = wd_gmem[j, :]
      h = _sampled_h(x, x_gmem, r, wup_gmem, j, g) if gated else g
      return acc + h * wd.astype(jnp.float32), l1 + jnp.abs(h)

    acc, l1 = _walk_entries(words_gmem, counts_gmem, r, rowok_gmem[r] != 0, slots=slots,
                            n_tiles=n_tiles, entry=entry, init=(acc0, jnp.float32(0.0)))
    y_gmem[r, :] = acc.astype(y_gmem.dtype)
    l1_gmem[r] = l1
    return 0

  lax.fori_loop(0, rows_per_cta, row_body, 0)


def _sddmm_kernel(x_gmem, words_gmem, counts_gmem, rowok_gmem, wup_gmem, hw_gmem, *,
                  rows_per_cta: int, slots: int, n_tiles: int, x_mode: str):
  """Split mode, first pass (sampled up projection): rewrites each valid gate word (j, g_j) of
  an ok row as (j, h_j), h_j = bf16(g_j * bf16(x_r . W_up[:, j])); other slots are not written.

  Same walk as ``_kernel_prefetch``, but nothing is accumulated: a row holds only x_r (or
  nothing, ``x_mode="reload"``) across entries, so more rows fit on an SM.
  """
  base = lax.axis_index("r") * rows_per_cta

  def row_body(i, _):
    r = base + i
    x, _ = _row_start(x_gmem, wup_gmem, r, True, x_mode)

    def entry(t, k, w, state):
      j, g = _decode(t, w)
      h = _sampled_h(x, x_gmem, r, wup_gmem, j, g)
      h_bits = lax.shift_right_logical(lax.bitcast_convert_type(h, jnp.int32), 16)
      hw_gmem[r, t * slots + k] = (w & jnp.int32(-65536)) | h_bits
      return state

    _walk_entries(words_gmem, counts_gmem, r, rowok_gmem[r] != 0, slots=slots,
                  n_tiles=n_tiles, entry=entry, init=jnp.int32(0))
    return 0

  lax.fori_loop(0, rows_per_cta, row_body, 0)


def sparse_down(x, words, counts, row_ok, w_up_t, w_down, *, compression: int = 8,
                rows_per_cta: int = 1, group: int = 1, prefetch: bool = True,
                split: bool = False, x_mode: str = "reload", interpret=False):
  """y [M, D] bf16 and l1 [M] f32 from the packed gate. ``w_up_t`` may be None (non-gated).

  ``prefetch=True`` (default) runs ``_kernel_prefetch`` (index loads software-pipelined;
  ``group`` is then ignored); ``prefetch=False`` the v1 kernel with ``group`` tiles side by side.
  ``split=True`` (gated only) runs two kernels instead of the fused one: ``_sddmm_kernel``
  rewrites the words as (j, h_j), then the non-gated ``_kernel_prefetch`` accumulates y; neither
  holds both x_r and the accumulator, and the second has no cross-thread reduction. Same bits as
  the fused kernel. ``x_mode`` ("f32", "bf16", "reload"): where x_r lives (``common.hold_row``);
  "reload" (default) measured 0.652 -> 0.610 ms on an H100 (71 instead of 79 registers: 7 CTAs
  per SM instead of 6; PERF.md).
  """
  if x_mode not in common.ROW_MODES:
    raise ValueError(f"{x_mode=} must be one of {common.ROW_MODES}")
  m, d = x.shape
  h, d2 = w_down.shape
  gated = w_up_t is not None
  if d != d2 or (gated and w_up_t.shape != (h, d)):
    raise ValueError(f"shape mismatch: {x.shape=} {w_down.shape=} "
                     f"{None if w_up_t is None else w_up_t.shape}")
  if d % 128 or h % common.TILE_N or m % rows_per_cta:
    raise ValueError(f"sparse_down needs D % 128 == 0, H % 256 == 0, M % rows_per_cta == 0;"
                     f" got {x.shape=} {w_down.shape=} {rows_per_cta=}")
  slots = common.TILE_N // compression
  n_tiles = h // common.TILE_N
  if not gated:
    w_up_t = jnp.zeros((8, 128), w_down.dtype)  # unused placeholder operand
  params = common.gather_kernel_params()
  if split and gated:
    with common.interpret_context(bool(interpret)):
      hw = plgpu.kernel(
          functools.partial(_sddmm_kernel, rows_per_cta=rows_per_cta, slots=slots,
                            n_tiles=n_tiles, x_mode=x_mode),
          out_type=jax.ShapeDtypeStruct(words.shape, jnp.int32),
          grid=(m // rows_per_cta,),
          grid_names=("r",),
          compiler_params=params,
          interpret=common.interpret_params(interpret),
          kernel_name="twell_sampled_up",
      )(x, words, counts, row_ok, w_up_t)
    return sparse_down(x, hw, counts, row_ok, None, w_down, compression=compression,
                       rows_per_cta=rows_per_cta, interpret=interpret)
  with common.interpret_context(bool(interpret)):
    if prefetch:
      body = functools.partial(_kernel_prefetch, rows_per_cta=rows_per_cta, slots=slots,
                               n_tiles=n_tiles, gated=gated, x_mode=x_mode)
    else:
      body = functools.partial(_kernel, rows_per_cta=rows_per_cta, slots=slots,
                               n_tiles=n_tiles, gated=gated, group=min(group, n_tiles))
    f = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((m, d), x.dtype),
                  jax.ShapeDtypeStruct((m,), jnp.float32)),
        grid=(m // rows_per_cta,),
        grid_names=("r",),
        compiler_params=params,
        interpret=common.interpret_params(interpret),
        kernel_name="twell_gated_down" if gated else "twell_down",
    )
    return f(x, words, counts, row_ok, w_up_t, w_down)
