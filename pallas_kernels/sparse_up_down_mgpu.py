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

Mapping: one CTA (one warpgroup, 128 threads) per token row; a row's x and
its f32 accumulator live in registers (D/128 values per thread each), the packed words and
counts are read as scalars straight from GMEM, weight rows are loaded from GMEM (L2) into
registers with 16-byte vector loads. A row's walk ends after its last entry (``row_entries``);
rows given 0 entries (overflow rows: some tile holds more than S entries) are skipped, the
caller computes them on another path.
No tensor cores: each active entry costs 2 D-long row reads and ~4D FMAs; the scalar index
loads are issued one step ahead (``_walk_entries``), so only the weight-row loads and the
reduction stay on each entry's dependency chain.

Shapes: D % 128 == 0, H % 256 == 0 (the caller pads with zeros); any M.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common as common


def _row_start(x_gmem, wd_gmem, r, gated: bool, x_mode: str = "f32"):
  """(x_r held per ``x_mode`` (``common.hold_row``) or None when non-gated, a zero f32 [D]
  accumulator)."""
  acc0 = common.zeros_like_row(wd_gmem[0, :])
  if not gated:
    return None, acc0
  return common.hold_row(x_gmem, r, x_mode), acc0


def _decode(t, w, col_start: int = 0):
  """Packed word of tile t -> (hidden column j, value as f32); the packed tiles start at
  hidden column ``col_start``."""
  j = col_start + t * common.TILE_N + (lax.shift_right_logical(w, 16) & (common.TILE_N - 1))
  return j, lax.bitcast_convert_type(lax.shift_left(w, 16), jnp.float32)


def _sampled_h(x, x_gmem, r, wup_gmem, j, g):
  """h_j = bf16(g_j * bf16(x_r . W_up[:, j])) as f32 (x_r held per ``common.hold_row``)."""
  u = jnp.sum(common.row_at(x, x_gmem, r) * wup_gmem[j, :].astype(jnp.float32))
  u = u.astype(jnp.bfloat16).astype(jnp.float32)
  return (g * u).astype(jnp.bfloat16).astype(jnp.float32)


def _walk_entries(words_gmem, counts_gmem, r, n_entries, *, slots: int, n_tiles: int,
                  chunk: int, entry, init):
  """Folds ``entry(t, k, w, state) -> state`` over the packed entries of row r, tile by tile,
  until ``n_entries`` (the row's entry count; 0: none) have been seen.

  The walk goes ``chunk`` tiles at a time with its scalar loads software-pipelined: the next
  chunk's tile counts and first words are loaded (independent loads, one L2 round trip for
  all of them) before the current chunk's entries run, and inside a tile the next entry's
  word is loaded before ``entry`` issues the current entry's weight rows, so only the
  weight-row loads and the reduction stay on each entry's dependency chain. The walk ends
  after the chunk holding the row's last entry: once the hot features are dense, most rows
  hold zero or one cold entry and walk none or a few of their tiles.
  """
  chunk = min(chunk, n_tiles)
  n_chunks = -(-n_tiles // chunk)
  pick = lambda values, i: functools.reduce(
      lambda acc, iv: jnp.where(i == iv[0], iv[1], acc), enumerate(values[1:], 1), values[0])

  def load_chunk(c):
    tiles = [jnp.minimum(c * chunk + i, n_tiles - 1) for i in range(chunk)]
    counts = tuple(jnp.where(c * chunk + i < n_tiles,
                             jnp.minimum(counts_gmem[r, t * common.COUNT_LANES], slots), 0)
                   for i, t in enumerate(tiles))
    return counts, tuple(words_gmem[r, t * slots] for t in tiles)

  def run_chunk(c, counts, firsts, state):
    def tile_body(i, state):
      t = c * chunk + i

      def entry_body(k, carry):
        state, w = carry
        w_next = words_gmem[r, t * slots + jnp.minimum(k + 1, slots - 1)]
        return entry(t, k, w, state), w_next

      state, _ = lax.fori_loop(0, pick(counts, i), entry_body, (state, pick(firsts, i)))
      return state

    if chunk == 1:
      return tile_body(0, state)
    return lax.fori_loop(0, chunk, tile_body, state)

  def cond(carry):
    c, seen = carry[:2]
    return jnp.logical_and(c < n_chunks, seen < n_entries)

  def body(carry):
    c, seen, counts, firsts, state = carry
    next_counts, next_firsts = load_chunk(jnp.minimum(c + 1, n_chunks - 1))
    state = run_chunk(c, counts, firsts, state)
    return c + 1, seen + functools.reduce(jnp.add, counts), next_counts, next_firsts, state

  counts, firsts = load_chunk(jnp.int32(0))
  return lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), counts, firsts, init))[4]


def _kernel(x_gmem, words_gmem, counts_gmem, entries_gmem, wup_gmem, wd_gmem, init_gmem, y_gmem,
            l1_gmem, *, slots: int, n_tiles: int, gated: bool, x_mode: str, has_init: bool,
            col_start: int, chunk: int):
  r = lax.axis_index("r")
  x, acc0 = _row_start(x_gmem, wd_gmem, r, gated, x_mode)
  if has_init:
    acc0 = init_gmem[r, :].astype(jnp.float32)

  def entry(t, k, w, state):
    del k
    j, g = _decode(t, w, col_start)
    acc, l1 = state
    wd = wd_gmem[j, :]
    h = _sampled_h(x, x_gmem, r, wup_gmem, j, g) if gated else g
    return acc + h * wd.astype(jnp.float32), l1 + jnp.abs(h)

  acc, l1 = _walk_entries(words_gmem, counts_gmem, r, entries_gmem[r], slots=slots,
                          n_tiles=n_tiles, chunk=chunk, entry=entry,
                          init=(acc0, jnp.float32(0.0)))
  y_gmem[r, :] = acc.astype(y_gmem.dtype)
  l1_gmem[r] = l1


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpDownConfig:
  """Tuned choices of the kernel (every choice gives the same bits).

  x_mode: where x_r lives across its row's entries (``_common.hold_row``): "reload" (read
    again at each entry, an L1 hit) keeps no registers across entries, so more CTAs fit on an
    SM: 0.610 ms against 0.652 for "f32" on an H100 at the paper shape (71 vs 79 registers).
  count_chunk: tiles whose counts and first words the row walk loads at once, a chunk ahead
    (one L2 round trip per chunk, at the cost of registers). H100, paper shape, device ms for
    chunks of 1 / 2 / 4 / 8 tiles: uniform 30 entries per row 0.692 / 0.720 / 0.707 / 0.897;
    a captured layer with 0.14 cold entries per row 0.037 / 0.038 / 0.042 / 0.043, one with
    3.3 0.324 / 0.322 / 0.318 / 0.334 (the project's up_down sweep).
  """
  x_mode: str = "reload"
  count_chunk: int = 1

  def __post_init__(self):
    if self.x_mode not in common.ROW_MODES:
      raise ValueError(f"{self.x_mode=} must be one of {common.ROW_MODES}")
    if not 1 <= self.count_chunk <= 16:
      raise ValueError(f"{self.count_chunk=} must be in [1, 16]")


def sparse_up_down(x, words, counts, row_entries, w_up_t, w_down, *, compression: int = 8,
                   col_start: int = 0, y_init=None, config: UpDownConfig = UpDownConfig(),
                   interpret=False):
  """y [M, D] x.dtype and l1 [M] f32 from the packed gate (``gate_pack_mgpu.gate_pack``).

  x [M, D]; words [M, T*S], counts [M, T*8] int32 (S = 256 / compression) of the hidden
  columns from ``col_start`` on (``gate_pack``'s ``col_start``); row_entries [M] int32: row r's
  number of packed entries (the sum of its tile counts, each at most S), or 0 to skip the row
  (it is computed elsewhere): the walk ends once it has seen them; w_up_t [H, D] (None: non-gated), w_down [H, D].
  ``y_init`` [M, D] (optional) is added to each row's sum before its one rounding; l1 counts
  only the packed entries.
  """
  m, d = x.shape
  h, d2 = w_down.shape
  gated = w_up_t is not None
  if d != d2 or (gated and w_up_t.shape != (h, d)):
    raise ValueError(f"shape mismatch: {x.shape=} {w_down.shape=} "
                     f"{None if w_up_t is None else w_up_t.shape}")
  if d % 128 or h % common.TILE_N:
    raise ValueError(f"sparse_up_down needs D % 128 == 0 and H % 256 == 0; got {x.shape=} "
                     f"{w_down.shape=}")
  slots = common.TILE_N // compression
  if col_start % common.TILE_N or words.shape[1] != (h - col_start) // common.TILE_N * slots:
    raise ValueError(f"sparse_up_down: words {words.shape} must hold the {slots}-slot tiles of "
                     f"hidden columns [{col_start}, {h}) (col_start a multiple of 256)")
  if not gated:
    w_up_t = jnp.zeros((8, 128), w_down.dtype)  # unused placeholder operand
  has_init = y_init is not None
  if has_init and y_init.shape != (m, d):
    raise ValueError(f"sparse_up_down: {y_init.shape=} must be {(m, d)}")
  if not has_init:
    y_init = jnp.zeros((8, 128), x.dtype)       # unused placeholder operand
  with common.interpret_context(bool(interpret)):
    f = plgpu.kernel(
        functools.partial(_kernel, slots=slots, n_tiles=(h - col_start) // common.TILE_N,
                          gated=gated, x_mode=config.x_mode, has_init=has_init,
                          col_start=col_start, chunk=config.count_chunk),
        out_type=(jax.ShapeDtypeStruct((m, d), x.dtype),
                  jax.ShapeDtypeStruct((m,), jnp.float32)),
        grid=(m,),
        grid_names=("r",),
        compiler_params=common.gather_kernel_params(),
        interpret=common.interpret_params(interpret),
        kernel_name="twell_up_down" if gated else "twell_down",
    )
    return common.call_kernel(f, x, words, counts, row_entries, w_up_t, w_down, y_init)
