"""Per-call activation statistics of a feed-forward block (L1 for the loss, L0 and layout counters)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import _common as common
from pallas_kernels._common import TILE_N   # the TwELL tile: `max_tile_nnz` counts per tile

__all__ = ["FFNStats", "tile_stats", "stats_from_mask", "empty_stats", "stack"]

# `twell_jax.ffn`'s default ELL width (`heavy_rows_by_hot` counts rows over it).
DEFAULT_ELL_WIDTH = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FFNStats:
  """Statistics of the hidden activation h [M, H] of one `twell_jax.ffn` call.

  Only `overflow_rows` depends on the implementation that ran (it counts that
  implementation's own overflow path); every other field is the same function of the
  activation pattern whichever ran, l1 up to the rounding of h.

  Attributes:
    l1: f32 scalar, differentiable: mean over the M tokens of sum_j |h_mj|
      (the reference code's normalization; multiply by H for the paper's
      per-element mean).
    nnz_per_token: f32 scalar: mean over tokens of the number of active
      features (relu gate > 0; h != 0 for non-ReLU activations).
    max_tile_nnz: int32 scalar: most active features in one row of one
      256-column tile (TwELL slots per tile are 256 / compression).
    overflow_rows: int32 scalar: rows that took the overflow path of the
      implementation (TwELL tile overflow for "mosaic_gpu", rows over the ELL
      width for "xla", 0 for "dense").
    feature_counts: int32 [H]: tokens of the call on which feature j was active
      (its popularity: `twell_jax.sort_features` orders features by it).
    heavy_rows_by_hot: int32 [ceil(H / 256)]: entry t counts the rows with more than the
      call's `ell_width` active features past the first 256 t (or more than 32 in one
      256-column tile there): with the features in their current order, the rows that the
      sparse training kernels would compute on their dense tail with K = 256 t hot features
      (what the trainer's per-layer choice weighs; `train.models.layer_choice`).
    implementation: str, static (pytree metadata, not an array): the implementation that
      ran ("dense", "xla", "mosaic_gpu", "decode"; what `implementation=None` resolved to).
      Stats combined by `stack` from calls of different implementations hold their names
      joined by "+"; "" where no `twell_jax.ffn` call set it.
    fired (property): bool [H], feature_counts > 0 (for dead-neuron tracking).
  """

  l1: jax.Array
  nnz_per_token: jax.Array
  max_tile_nnz: jax.Array
  overflow_rows: jax.Array
  feature_counts: jax.Array
  heavy_rows_by_hot: jax.Array
  implementation: str = dataclasses.field(default="", metadata={"static": True})

  @property
  def fired(self) -> jax.Array:
    return self.feature_counts > 0


def tile_stats(active: jax.Array, ell_width: int = DEFAULT_ELL_WIDTH):
  """(nnz_per_token, max_tile_nnz, feature_counts, heavy_rows_by_hot) from a boolean activity
  mask [M, H] (`FFNStats`; `ell_width`: the call's)."""
  m, h = active.shape
  pad = (-h) % TILE_N
  tiles = jnp.pad(active, ((0, 0), (0, pad))).reshape(m, -1, TILE_N)
  tile_nnz = jnp.sum(tiles, axis=-1, dtype=jnp.int32)
  nnz_per_token = jnp.sum(tile_nnz, dtype=jnp.float32) / m
  return (nnz_per_token, jnp.max(tile_nnz), jnp.sum(active, axis=0, dtype=jnp.int32),
          common.heavy_rows_by_tile(tile_nnz.T, ell_width))


def stats_from_mask(active: jax.Array, l1, overflow_rows=None,
                    ell_width: int = DEFAULT_ELL_WIDTH) -> FFNStats:
  """FFNStats of a call whose activity mask [M, H] is known (dense paths)."""
  nnz, max_tile, counts, heavy = tile_stats(active, ell_width)
  if overflow_rows is None:
    overflow_rows = jnp.zeros((), jnp.int32)
  return FFNStats(l1=l1, nnz_per_token=nnz, max_tile_nnz=max_tile,
                  overflow_rows=overflow_rows, feature_counts=counts, heavy_rows_by_hot=heavy)


def empty_stats(h: int) -> FFNStats:
  """FFNStats of a call with no tokens."""
  zero_f, zero_i = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
  return FFNStats(l1=zero_f, nnz_per_token=zero_f, max_tile_nnz=zero_i,
                  overflow_rows=zero_i, feature_counts=jnp.zeros((h,), jnp.int32),
                  heavy_rows_by_hot=jnp.zeros((-(-h // TILE_N),), jnp.int32))


def from_dict(d: dict) -> FFNStats:
  """FFNStats from the kernels' stats dict (same keys)."""
  return FFNStats(**{f.name: d[f.name] for f in dataclasses.fields(FFNStats)
                     if not f.metadata.get("static")})


def stack(stats: Sequence[FFNStats], *, concatenate: bool = False) -> FFNStats:
  """The stats of several calls as one FFNStats: every array stacked on a new leading axis
  (a model's per-layer stats), or with `concatenate` joined along its leading axis (runs of
  layers already stacked). `implementation` is the calls' distinct names in order of first
  appearance, joined by "+" (one name when all agree; names already joined count one by
  one): a model whose layers run different implementations, which `jax.tree.map` over
  their stats cannot combine, the name being part of the tree structure."""
  if not stats:
    raise ValueError("stats must hold at least one FFNStats; got none.")
  names = dict.fromkeys(name for st in stats for name in st.implementation.split("+") if name)
  join = jnp.concatenate if concatenate else jnp.stack
  arrays = [dataclasses.replace(st, implementation="") for st in stats]
  combined = jax.tree.map(lambda *a: join(a), *arrays)
  return dataclasses.replace(combined, implementation="+".join(names))
