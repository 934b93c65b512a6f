"""Sparse layouts of a hidden activation h [M, N]: TwELL and hybrid ELL + dense tail.

Shape letters used in this package:
  M  rows (tokens)            N  columns (hidden features, H in the FFN)
  T  tiles per row (N / tile_n)          S  slots per tile (tile_n / compression)
  W  ELL width (slots per row, hybrid)   R  static row capacity of an overflow/tail part

Both layouts are exact for every input. A row is "nonzero" at a column when the
bit pattern of h there is not +0.0 (so -0.0 and NaN are stored like any other
value and `to_dense` round-trips every bit). Entries are kept in increasing
column order, so the layouts are deterministic (the paper's CUDA epilogue
orders entries by shared-memory atomics instead).

Static capacities and exactness. Both layouts have a part of static size for
rows that do not fit the compact part (TwELL: a tile holding more than S
nonzeros; hybrid: a row holding more than W). JAX needs static shapes, so that
part holds at most R rows. When more rows need it, no static layout smaller
than dense can hold the data, so the layout keeps the source array in
`fallback` and `to_dense` returns it: the result is still exact, and the event
is visible (`capacity_exceeded`). `fallback` is None when R >= M (nothing can
exceed). Passing the source through costs no copy outside `jit`; inside a
larger jitted program it keeps h alive, which is why the FFN implementations
do not use these containers as residuals but recompute from x instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels import _common as common
from twell_jax import validation

__all__ = ["TwELL", "Hybrid", "to_twell", "to_hybrid", "to_dense", "default_capacity"]

_SUPPORTED_COMPRESSION = (2, 4, 8, 16)


def default_capacity(m: int) -> int:
  """Default static row capacity of an overflow/tail part: M/8, a multiple of 8, at most M.

  The paper's training kernels use 2048 tail rows for 16384 tokens (1/8).
  """
  return min(m, max(8, 8 * math.ceil(m / 64)))


def _nonzero_mask(h: jax.Array) -> jax.Array:
  """True where the bit pattern of h is not all zeros (+0.0 is the only 'zero')."""
  bits_dtype = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[h.dtype.itemsize]
  return jax.lax.bitcast_convert_type(h, bits_dtype) != 0


def _first_k_nonzero(mask: jax.Array, k: int) -> jax.Array:
  """Indices of the first k True entries of each row of `mask` [..., L] (then of False ones).

  Uses top_k on a score that ranks True entries by increasing position ahead
  of all False entries, so the order is the column order.
  """
  length = mask.shape[-1]
  pos = jnp.arange(length, dtype=jnp.int32)
  # Scores fit int32 exactly; True entries in (L, 2L], False in (0, L].
  score = jnp.where(mask, 2 * length - pos, length - pos)
  _, idx = jax.lax.top_k(score, k)
  return idx.astype(jnp.int32)


def _check_matrix(h, name: str = "h") -> jax.Array:
  h = jnp.asarray(h)
  if h.ndim != 2:
    raise ValueError(f"{name} must be a 2-D array [M, N]; got shape {h.shape}.")
  if h.shape[0] < 1:
    raise ValueError(f"{name} must have at least one row; got shape {h.shape}.")
  if not jnp.issubdtype(h.dtype, jnp.floating):
    raise ValueError(f"{name} must have a floating dtype (bf16 expected); got {h.dtype}.")
  return h


def _check_capacity(value, m: int, name: str) -> int:
  value = validation.static_int(value, name, minimum=0, allow_none=True, none_means="M/8")
  return default_capacity(m) if value is None else min(value, m)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TwELL:
  """Tile-wise ELLPACK layout of h [M, N] (the paper's inference format).

  Per row and per `tile_n`-column tile: up to S = tile_n / compression
  nonzeros, in column order.

  Fields:
    values:   [M, T, S] h.dtype; the tile's nonzeros, 0 in unused slots.
    columns:  [M, T, S] int32; their GLOBAL column; unused slots hold the
              tile's first column, so gathers by column stay in bounds.
    counts:   [M, T] int32; true number of nonzeros in the tile. A count > S
              marks an overflow row, whose tile slots then hold only the first S.
    overflow_index:  [R] int32; overflow rows in increasing order, padded with M.
    overflow_values: [R, N] h.dtype; those rows, dense and complete.
    overflow_rows:   int32 scalar; number of overflow rows (may exceed R).
    fallback: [M, N] source array when R < M, else None (see module doc).
  """

  values: jax.Array
  columns: jax.Array
  counts: jax.Array
  overflow_index: jax.Array
  overflow_values: jax.Array
  overflow_rows: jax.Array
  fallback: Optional[jax.Array]
  tile_n: int = dataclasses.field(metadata=dict(static=True))
  compression: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, int]:
    m, t, _ = self.values.shape
    return (m, t * self.tile_n)

  @property
  def slots(self) -> int:
    return self.tile_n // self.compression

  @property
  def capacity(self) -> int:
    return self.overflow_index.shape[0]

  @property
  def capacity_exceeded(self) -> jax.Array:
    """True when more rows overflowed than the overflow part holds (then `fallback` is used)."""
    return self.overflow_rows > self.capacity


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Hybrid:
  """Hybrid ELL + dense-tail layout of h [M, N] (the paper's training format).

  Fields:
    ell_values:  [M, W] h.dtype; a row's nonzeros in column order (0-padded).
                 Heavy rows (more than W nonzeros) keep their first W here too.
    ell_columns: [M, W] int32; their columns; unused slots hold column 0.
    row_nnz:     [M] int32; true nonzeros per row.
    tail_index:  [R] int32; heavy rows in increasing order, padded with M.
    tail_values: [R, N] h.dtype; those rows, dense and complete.
    heavy_rows:  int32 scalar; number of heavy rows (may exceed R).
    fallback:    [M, N] source array when R < M, else None (see module doc).
  """

  ell_values: jax.Array
  ell_columns: jax.Array
  row_nnz: jax.Array
  tail_index: jax.Array
  tail_values: jax.Array
  heavy_rows: jax.Array
  fallback: Optional[jax.Array]
  num_columns: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, int]:
    return (self.ell_values.shape[0], self.num_columns)

  @property
  def ell_width(self) -> int:
    return self.ell_values.shape[1]

  @property
  def capacity(self) -> int:
    return self.tail_index.shape[0]

  @property
  def capacity_exceeded(self) -> jax.Array:
    """True when more rows are heavy than the tail holds (then `fallback` is used)."""
    return self.heavy_rows > self.capacity


def to_twell(h, *, tile_n: int = 256, compression: int = 8,
             overflow_capacity: Optional[int] = None) -> TwELL:
  """Packs h [M, N] (N a multiple of tile_n) into TwELL; see `TwELL`.

  Args:
    h: [M, N] floating array (bf16 in the FFN), M >= 1.
    tile_n: tile width; the paper uses 256.
    compression: C in {2, 4, 8, 16}; S = tile_n / C slots per tile.
    overflow_capacity: R, static number of dense overflow rows kept; None
      means `default_capacity(M)`.
  """
  h = _check_matrix(h)
  if validation.static_int(tile_n, "tile_n", minimum=8) % 8:
    raise ValueError(f"tile_n must be a positive multiple of 8; got {tile_n!r}.")
  if compression not in _SUPPORTED_COMPRESSION:
    raise ValueError(f"compression must be one of {_SUPPORTED_COMPRESSION}; got {compression!r}.")
  m, n = h.shape
  if n % tile_n:
    raise ValueError(f"h.shape[1] (N={n}) must be a multiple of tile_n={tile_n}; pad h first.")
  r = _check_capacity(overflow_capacity, m, "overflow_capacity")
  t, s = n // tile_n, tile_n // compression

  tiles = h.reshape(m, t, tile_n)
  mask = _nonzero_mask(tiles)
  counts = jnp.sum(mask, axis=-1, dtype=jnp.int32)
  local = _first_k_nonzero(mask, s)                      # [M, T, S]
  valid = jnp.arange(s, dtype=jnp.int32) < counts[..., None]
  values = jnp.where(valid, jnp.take_along_axis(tiles, local, axis=-1), jnp.zeros((), h.dtype))
  tile_start = (jnp.arange(t, dtype=jnp.int32) * tile_n)[None, :, None]
  columns = tile_start + jnp.where(valid, local, 0)

  row_overflows = jnp.any(counts > s, axis=-1)
  overflow_rows = jnp.sum(row_overflows, dtype=jnp.int32)
  (overflow_index,) = jnp.nonzero(row_overflows, size=r, fill_value=m)
  overflow_index = overflow_index.astype(jnp.int32)
  return TwELL(values=values, columns=columns, counts=counts,
               overflow_index=overflow_index,
               overflow_values=common.take_rows(h, overflow_index),
               overflow_rows=overflow_rows,
               fallback=h if r < m else None,
               tile_n=tile_n, compression=compression)


def to_hybrid(h, *, ell_width: int = 128, tail_rows: Optional[int] = None) -> Hybrid:
  """Packs h [M, N] into the hybrid ELL + dense-tail layout; see `Hybrid`.

  Args:
    h: [M, N] floating array, M >= 1, any N.
    ell_width: W, slots per row of the ELL part (capped at N).
    tail_rows: R, static number of dense tail rows; None means `default_capacity(M)`.
  """
  h = _check_matrix(h)
  validation.static_int(ell_width, "ell_width", minimum=1)
  m, n = h.shape
  w = min(ell_width, n)
  r = _check_capacity(tail_rows, m, "tail_rows")

  mask = _nonzero_mask(h)
  row_nnz = jnp.sum(mask, axis=-1, dtype=jnp.int32)
  cols = _first_k_nonzero(mask, w)                       # [M, W]
  valid = jnp.arange(w, dtype=jnp.int32) < row_nnz[:, None]
  ell_values = jnp.where(valid, jnp.take_along_axis(h, cols, axis=-1), jnp.zeros((), h.dtype))
  ell_columns = jnp.where(valid, cols, 0)

  heavy = row_nnz > w
  heavy_rows = jnp.sum(heavy, dtype=jnp.int32)
  (tail_index,) = jnp.nonzero(heavy, size=r, fill_value=m)
  tail_index = tail_index.astype(jnp.int32)
  return Hybrid(ell_values=ell_values, ell_columns=ell_columns, row_nnz=row_nnz,
                tail_index=tail_index, tail_values=common.take_rows(h, tail_index),
                heavy_rows=heavy_rows, fallback=h if r < m else None,
                num_columns=n)


def _scatter_rows(dense: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
  """dense[index] = rows, skipping padding indices (== M)."""
  return dense.at[index].set(rows, mode="drop", unique_indices=True)


def _with_fallback(layout, compact: jax.Array) -> jax.Array:
  if layout.fallback is None:
    return compact
  return jnp.where(layout.capacity_exceeded, layout.fallback, compact)


def to_dense(s) -> jax.Array:
  """Decodes a `TwELL` or `Hybrid` back to the dense [M, N] array, bit-exactly."""
  if isinstance(s, TwELL):
    m, n = s.shape
    t, slots = s.values.shape[1:]
    valid = jnp.arange(slots, dtype=jnp.int32) < s.counts[..., None]
    # Unused slots point past the end and are dropped, so a real entry at a
    # tile's first column is never overwritten by a padding zero.
    cols = jnp.where(valid, s.columns, n)
    rows = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[:, None, None], cols.shape)
    dense = jnp.zeros((m, n), s.values.dtype).at[rows, cols].set(
        s.values, mode="drop", unique_indices=True)
    return _with_fallback(s, _scatter_rows(dense, s.overflow_index, s.overflow_values))
  if isinstance(s, Hybrid):
    m, n = s.shape
    valid = jnp.arange(s.ell_width, dtype=jnp.int32) < s.row_nnz[:, None]
    cols = jnp.where(valid, s.ell_columns, n)
    rows = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[:, None], cols.shape)
    dense = jnp.zeros((m, n), s.ell_values.dtype).at[rows, cols].set(
        s.ell_values, mode="drop", unique_indices=True)
    return _with_fallback(s, _scatter_rows(dense, s.tail_index, s.tail_values))
  raise ValueError(f"to_dense expects a twell_jax.TwELL or twell_jax.Hybrid; got {type(s).__name__}.")
