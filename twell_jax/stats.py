"""Per-call activation statistics of a feed-forward block (L1 for the loss, L0 and layout counters)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["FFNStats", "TILE_N", "tile_stats", "stats_from_mask", "empty_stats"]

# Tile width used for the `max_tile_nnz` statistic (the TwELL tile of the paper).
TILE_N = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FFNStats:
  """Statistics of the hidden activation h [M, H] of one `twell_jax.ffn` call.

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
    fired (property): bool [H], feature_counts > 0 (for dead-neuron tracking).
  """

  l1: jax.Array
  nnz_per_token: jax.Array
  max_tile_nnz: jax.Array
  overflow_rows: jax.Array
  feature_counts: jax.Array

  @property
  def fired(self) -> jax.Array:
    return self.feature_counts > 0


def tile_stats(active: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(nnz_per_token, max_tile_nnz, feature_counts) from a boolean activity mask [M, H]."""
  m, h = active.shape
  pad = (-h) % TILE_N
  tiles = jnp.pad(active, ((0, 0), (0, pad))).reshape(m, -1, TILE_N)
  tile_nnz = jnp.sum(tiles, axis=-1, dtype=jnp.int32)
  nnz_per_token = jnp.sum(tile_nnz, dtype=jnp.float32) / m
  return nnz_per_token, jnp.max(tile_nnz), jnp.sum(active, axis=0, dtype=jnp.int32)


def stats_from_mask(active: jax.Array, l1, overflow_rows=None) -> FFNStats:
  """FFNStats of a call whose activity mask [M, H] is known (dense paths)."""
  nnz, max_tile, counts = tile_stats(active)
  if overflow_rows is None:
    overflow_rows = jnp.zeros((), jnp.int32)
  return FFNStats(l1=l1, nnz_per_token=nnz, max_tile_nnz=max_tile,
                  overflow_rows=overflow_rows, feature_counts=counts)


def empty_stats(h: int) -> FFNStats:
  """FFNStats of a call with no tokens."""
  zero_f, zero_i = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
  return FFNStats(l1=zero_f, nnz_per_token=zero_f, max_tile_nnz=zero_i,
                  overflow_rows=zero_i, feature_counts=jnp.zeros((h,), jnp.int32))


def from_dict(d: dict) -> FFNStats:
  """FFNStats from the kernels' stats dict (same keys)."""
  return FFNStats(**{f.name: d[f.name] for f in dataclasses.fields(FFNStats)})
