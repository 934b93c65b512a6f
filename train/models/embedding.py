"""The token embedding lookup, whose gradient is a sorted, blocked segment sum.

`lookup(table, tokens)` is `jnp.take(table, tokens, axis=0)`. Differentiated by JAX, that
take's transpose is a scatter-add of every token's row into a [V, D] table in the table's
dtype: one atomic add per element, all tokens of one id on the same addresses. Text is
skewed (the most frequent id of a batch can hold a tenth of its tokens), so the adds
serialize, and the scatter becomes one of a train step's largest kernels.

The custom VJP here computes the same sums without contention:

  1. sort the tokens by id (argsort of N ids) and gather the cotangent rows in that order;
  2. cut the sorted rows into blocks of `BLOCK`; within a block the rows of one id are
     contiguous, and one batched GEMM with a 0/1 matrix [BLOCK, BLOCK] per block adds each
     run of equal ids into the run's first row (f32 accumulation; 2 N BLOCK D FLOPs);
  3. scatter-add only those first rows into an f32 [V, D] table: an id meets at most
     count / BLOCK + 1 adds at one address instead of count.

The table's cotangent is cast to the table's dtype once, at the end (the autodiff path rounds
after every add). Under a mesh with batch axes in context the lookup runs per device under
`jax.shard_map` (as the FFN and the loss do): each device sums its own tokens and the
transpose of the replicated table input adds the devices' sums (the gradient all-reduce).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from twell_jax import sharded

# Rows per block of the segment sum: the 0/1 GEMM costs 2 BLOCK FLOPs per element of the
# cotangent, and an id's adds to one address drop by up to BLOCK.
BLOCK = 128


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """table[tokens]: [..., D] rows of table [V, D] (as `jnp.take`: ids outside [0, V) give
  NaN rows; they add nothing to the gradient)."""
  axes = sharded.split_axes(tokens.shape[0]) if tokens.ndim else ()
  if not axes:
    return _lookup(table, tokens)
  return jax.shard_map(_lookup, mesh=jax.sharding.get_abstract_mesh(),
                       in_specs=(P(), P(axes)), out_specs=P(axes),
                       axis_names=frozenset(axes), check_vma=False)(table, tokens)


@jax.custom_vjp
def _lookup(table, tokens):
  return jnp.take(table, tokens, axis=0)


def _fwd(table, tokens):
  return _lookup(table, tokens), (tokens, jnp.zeros((0,) + table.shape, table.dtype))


def _bwd(res, g):
  tokens, like = res
  v, d = like.shape[1:]
  grad = segment_sum(tokens.reshape(-1), g.reshape(-1, d), v)
  return grad.astype(like.dtype), None


_lookup.defvjp(_fwd, _bwd)


@functools.partial(jax.jit, static_argnums=(2, 3))
def segment_sum(ids: jax.Array, rows: jax.Array, num_segments: int,
                block: int = BLOCK) -> jax.Array:
  """f32 [num_segments, D]: out[v] = sum of rows[i] (f32) over i with ids[i] == v; ids
  outside [0, num_segments) are dropped. See the module docstring."""
  n, d = rows.shape
  order = jnp.argsort(ids, stable=True)
  # Invalid ids sort with the padding, past every valid one, and are dropped below.
  ids = jnp.where((ids >= 0) & (ids < num_segments), ids, num_segments)[order]
  rows = rows[order]
  pad = (-n) % block
  ids = jnp.pad(ids, (0, pad), constant_values=num_segments).reshape(-1, block)
  rows = jnp.pad(rows, ((0, pad), (0, 0))).reshape(-1, block, d)
  # A run of equal ids starts where the id changes (and at each block's first row).
  starts = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
  run = jnp.cumsum(starts, axis=1)                                     # [blocks, block]
  # adds[b, i, j]: row j of block b goes into row i, the first row of its run.
  adds = (run[:, :, None] == run[:, None, :]) & starts[:, :, None]
  # A 0/1 matrix is exact in any dtype; f32 rows take the full-precision GEMM.
  sums = jnp.einsum("bij,bjd->bid", adds.astype(rows.dtype), rows,
                    preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST)
  dest = jnp.where(starts, ids, num_segments).reshape(-1)
  return jnp.zeros((num_segments, d), jnp.float32).at[dest].add(
      sums.reshape(-1, d), mode="drop")
