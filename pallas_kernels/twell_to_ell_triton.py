"""TwELL tiles -> ELL rows and the dense-row list, in one kernel (Pallas, Triton backend).

The inference forward's glue between the gate kernel and the fused up / down kernel. For
the gate kernel's words [M, T*S] (record (r, t): S slots, the first min(counts[t, r], S) of
them packed words in column order) and counts [T, M], per row r:

    kept_t  = min(counts[t, r], S),   n_r = sum_t kept_t
    over_r  = some counts[t, r] > S  or  n_r > width            (its packed slots lost
                                                                 entries, or too many)
    take_r  = (over_r or nonfinite) and r < m                   (rows for the dense path)
    entries[r, k] = the k-th packed word of the row (tiles in order), k < n_r, else 0;
                    rows with take_r or over_r get n_r = 0 and no entries
    the dense-row list: rows[i], i < num_dense, the rows with take_r (in no particular
                    order), pos[r] their slot in it, -1 for the others.
``num_over`` counts the over rows below m (the forward's ``overflow_rows``).

Why a kernel of its own, and why Triton: the conversion is a per-thread gather (each slot of
each row reads its own word), which Mosaic GPU's warpgroup-wide arrays do not express, and
in XLA it takes a reduction over the counts, a cumulative sum over the tiles, a reduction
per slot, the gather, and for the dense-row list a cumulative sum over the rows and a
scatter: 11 small kernels and 0.04 ms at the paper shape on an H100, against this kernel's
0.018 ms. (jax marks the Triton backend deprecated; the forward's ``convert="xla"`` is the
same function without it.) Here one program handles ``rows_per_program`` rows: a loop over
the T tiles keeps each row's running count and each slot's word index, then one masked
gather reads the words. The dense-row list takes one atomic add per program that holds such
a row; the slots' order then depends on the schedule, which changes no result (each dense
row's output depends on that row only).

Shapes: M % rows_per_program == 0, words [M, T*S] int32, counts [T, M] int32; entries
[M, Wk], Wk = width rounded up to a power of two (slots past n_r are 0).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _common as common
from pallas_kernels import _target as target


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvertConfig:
  """Rows per program (a power of two dividing M), warps per program, and the tiles whose
  counts one step of the tile loop loads at once. At the paper shape on an H100 (M = 16384,
  T = 22, ~30 entries per row) one row per one-warp program takes 0.018 ms; 2, 4 or 8 rows
  0.019-0.022, more warps per program 0.021-0.031 (``python -m benchmarks.sweeps.sweep
  --what=up_down --specs=paper_16k``). Its work is the [rows, slots] sum over the tiles:
  22 x 128 compares per row, about 9 us of the H100's integer rate."""
  rows_per_program: int = 1
  num_warps: int = 1
  tiles_per_step: int = 8

  def __post_init__(self):
    r = self.rows_per_program
    if not common.is_pow2(r):
      raise ValueError(f"{self.rows_per_program=} must be a power of two")
    if self.tiles_per_step < 1:
      raise ValueError(f"{self.tiles_per_step=} must be >= 1")
    target.check_triton_warps(self.num_warps)


def entry_slots(width: int) -> int:
  """Wk: ``width`` rounded up to a power of two (Triton's block sizes are powers of two)."""
  return common.pow2_at_least(width)


def _kernel(counts_ref, words_ref, nonfinite_ref, _, entries_ref, n_ref, pos_ref, rows_ref,
            tally_ref, *, m: int, slots: int, width: int, br: int, unroll: int):
  t_tiles = counts_ref.shape[0]
  wk = entries_ref.shape[1]
  r0 = pl.program_id(0) * br
  row = r0 + jnp.arange(br, dtype=jnp.int32)
  k = jnp.arange(wk, dtype=jnp.int32)

  def tiles(j, carry):
    # ``unroll`` tiles per step: their count loads are issued together (a loop of one load
    # per step waits for each in turn).
    incl, idx, total = carry
    cs = [plt.load(counts_ref.at[jnp.minimum(j * unroll + q, t_tiles - 1), pl.ds(r0, br)],
                   mask=jnp.broadcast_to(j * unroll + q < t_tiles, (br,)), other=0)
          for q in range(unroll)]
    for c in cs:
      kept = jnp.minimum(c, slots)
      incl = incl + kept
      # Slot k lies past this tile when incl <= k: it skips the tile's S - kept unused slots.
      # (Tiles past T count 0: they add S only to slots k >= n, which hold no entry.)
      idx = idx + jnp.where(incl[:, None] <= k[None, :], (slots - kept)[:, None], 0)
      # One sum for both tests: a tile over S adds more than the width.
      total = total + jnp.where(c > slots, c + width + 1, c)
    return incl, idx, total

  zeros = jnp.zeros((br,), jnp.int32)
  _, idx, total = lax.fori_loop(0, pl.cdiv(t_tiles, unroll), tiles,
                                (zeros, jnp.broadcast_to(k[None, :], (br, wk)), zeros))
  over = total > width
  take = jnp.logical_and(jnp.logical_or(over, nonfinite_ref[0] != 0), row < m)
  n = jnp.where(jnp.logical_or(over, take), 0, total)
  valid = k[None, :] < n[:, None]
  word = plt.load(words_ref.at[row[:, None], jnp.where(valid, idx, 0)], mask=valid, other=0)
  entries_ref[pl.ds(r0, br), :] = word
  n_ref[pl.ds(r0, br)] = n

  taken = take.astype(jnp.int32)
  n_take = jnp.sum(taken)
  n_over = jnp.sum(jnp.logical_and(over, row < m).astype(jnp.int32))

  @pl.when(n_take == 0)
  def _none():
    pos_ref[pl.ds(r0, br)] = jnp.full((br,), -1, jnp.int32)

  @pl.when(n_take > 0)
  def _list():
    base = plt.atomic_add(tally_ref, jnp.int32(0), n_take)
    pos = base + jnp.cumsum(taken) - 1
    pos_ref[pl.ds(r0, br)] = jnp.where(take, pos, -1)
    # Lanes without a row point at the last slot, which only a taken row writes when every
    # row is taken (then no lane is masked): the interpreter's masked scatter writes the old
    # value back there, and must not race a taken row's store.
    plt.store(rows_ref.at[jnp.where(take, pos, rows_ref.shape[0] - 1)], row, mask=take)

  @pl.when(n_over > 0)
  def _count():
    plt.atomic_add(tally_ref, jnp.int32(1), n_over)


def twell_to_ell(words, counts, nonfinite, *, m: int, slots: int, width: int,
                 config: ConvertConfig = ConvertConfig(), interpret: bool = False):
  """(entries [M, Wk] int32, n [M] int32, pos [M] int32, rows [M] int32, tally [2] int32 =
  (num_dense, num_over)); see the module docstring. ``nonfinite``: a bool scalar, every row < m
  to the dense path when set. Wk = ``entry_slots(width)``. Entries of ``rows`` past
  ``num_dense`` are unspecified."""
  mp, ts = words.shape
  t = counts.shape[0]
  wk = entry_slots(width)
  br = config.rows_per_program
  if counts.shape != (t, mp) or ts != t * slots or mp % br or not 0 < m <= mp:
    raise ValueError(f"twell_to_ell: bad shapes {words.shape=} {counts.shape=} {slots=} "
                     f"{width=} {wk=} {m=} {br=}")
  out_shape = (jax.ShapeDtypeStruct((mp, wk), jnp.int32),
               jax.ShapeDtypeStruct((mp,), jnp.int32),
               jax.ShapeDtypeStruct((mp,), jnp.int32),
               jax.ShapeDtypeStruct((mp,), jnp.int32),
               jax.ShapeDtypeStruct((2,), jnp.int32))
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  f = pl.pallas_call(
      functools.partial(_kernel, m=m, slots=slots, width=width, br=br,
                        unroll=config.tiles_per_step),
      out_shape=out_shape,
      grid=(mp // br,),
      in_specs=[anywhere] * 4,
      out_specs=[anywhere] * 5,
      # The tally (dense rows, over rows) starts from the zeros passed in.
      input_output_aliases={3: 4},
      compiler_params=plt.CompilerParams(num_warps=config.num_warps),
      interpret=interpret,
      name="twell_to_ell",
  )
  flag = jnp.reshape(jnp.asarray(nonfinite, jnp.int32), (1,))
  entries, n, pos, rows, tally = f(counts, words, flag, jnp.zeros((2,), jnp.int32))
  return entries, n, pos, rows, tally
