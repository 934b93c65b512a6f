"""`twell_jax.ffn` on a device mesh: every device runs the FFN on its own tokens.

XLA cannot partition a custom call, so under plain GSPMD a batch-sharded x is all-gathered in
front of the Pallas kernels and every device computes the FFN of the whole batch. `ffn` here
runs the FFN under `jax.shard_map` over the batch axes of the mesh in context (`jax.set_mesh`
or `jax.sharding.use_abstract_mesh`; the axes named in `BATCH_AXES` that it has):

- x is split over its leading axis (or, when that does not divide, over the flattened tokens);
- the weights enter whole: under FSDP (weights sharded over "fsdp") XLA gathers each weight
  once per call, the activations are never gathered;
- each device runs `twell_jax.ffn` on its tokens (the kernels pad M, so any local M works;
  static capacities such as the default `tail_rows` = M / 8 are then per device);
- the statistics are reduced to their global values (l1 and nnz_per_token: mean over the
  equal shards; max_tile_nnz: max; overflow_rows and feature_counts: sum), so the loss and the
  metrics are those of an unsharded call;
- differentiated, the custom VJP's weight cotangents come out per device and the transpose
  of `shard_map` sums them over the batch axes: the all-reduce (a reduce-scatter where the
  weights are sharded) that GSPMD gives the weight gradients of a dense FFN.

Any mesh JAX makes works, its axes Explicit (`jax.make_mesh`'s default) or Auto, whatever
the sharding of x. With Explicit axes an array's sharding is part of its type, which
`shard_map` checks against its in_specs: x and the weights are resharded
(`jax.sharding.reshard`) to the split `shard_map` expects, and y back to x's sharding, as a
dense FFN's output has it. With Auto axes GSPMD places them, and y stays split over the
batch axes.

Every implementation goes through this path, "dense" included: one code path, and sparse and
dense runs differ only in the FFN they compute (the same per-device work, the same
collectives). Axes of the mesh that are not batch axes stay under GSPMD (`axis_names`), which
leaves room for a tensor-parallel axis. Without a mesh, with one device on the batch axes, or
when no axis of x divides over them, `ffn` is `twell_jax.ffn` (on whole operands where the
mesh has Explicit axes).

`check_vma=False`: the implementations' conditionals (`lax.cond` / `lax.switch` between the
sparse and the dense path) build per-branch constants that the varying-axes type check would
reject; the reductions below are written for the unchecked semantics (tested for equality
with unsharded calls, forward and gradients).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from twell_jax import api
from twell_jax import stats as stats_lib

__all__ = ["BATCH_AXES", "batch_axes", "split_axes", "gathered", "reduce_stats", "ffn"]

# Mesh axes that split the batch (data parallel, and FSDP, whose devices also hold distinct
# tokens); any other axis is left to GSPMD.
BATCH_AXES = ("data", "fsdp")


def batch_axes(mesh=None, names: Sequence[str] = BATCH_AXES) -> tuple[str, ...]:
  """The axes of `mesh` (default: the abstract mesh in context) among `names` that split the
  batch here: present and not already manual (inside an enclosing shard_map over them)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  manual = set(getattr(mesh, "manual_axes", ()))
  return tuple(a for a in mesh.axis_names if a in names and a not in manual)


def split_axes(rows: int, mesh=None) -> tuple[str, ...]:
  """The batch axes to split `rows` over (default mesh: the one in context); () when there
  are none, they hold one device, or they do not divide `rows`."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  axes = batch_axes(mesh)
  n = math.prod(mesh.shape[a] for a in axes)
  return axes if n > 1 and rows % n == 0 else ()


def _explicit(spec: P, mesh) -> P:
  """`spec` with only the mesh's Explicit axes (what `jax.sharding.reshard` takes)."""
  keep = set(getattr(mesh, "explicit_axes", ()))
  def entry(e):
    names = tuple(n for n in ((e,) if isinstance(e, str) else e or ()) if n in keep)
    return names[0] if len(names) == 1 else (names or None)
  return P(*(entry(e) for e in spec))


def _reshard(a, spec: P, mesh):
  """`a` laid out as `spec` on the Explicit axes of the mesh in context (`a` itself where
  the mesh has none: Auto axes are placed by GSPMD)."""
  if a is None or not getattr(mesh, "explicit_axes", ()):
    return a
  return jax.sharding.reshard(a, _explicit(spec, mesh))


def _reshape(a, shape, spec: P, mesh):
  """`a` reshaped to `shape`, laid out as `spec` where the mesh has Explicit axes: through
  the whole array there, since JAX cannot transpose (differentiate) a reshape that moves a
  split axis."""
  if not getattr(mesh, "explicit_axes", ()):
    return a.reshape(shape)
  return _reshard(_reshard(a, P(), mesh).reshape(shape), spec, mesh)


def _spec_of(a) -> P:
  """The PartitionSpec in `a`'s type (its Explicit axes; P() for none)."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  return getattr(sharding, "spec", None) or P()


def gathered(w):
  """`w` whole on every device of the mesh in context (FSDP: the weight's all-gather right
  where it is used, so that GSPMD never moves activations instead); `w` itself without a
  mesh. Cast a weight to the compute dtype first: the gather then moves half the bytes."""
  mesh = jax.sharding.get_abstract_mesh()
  if not batch_axes(mesh):
    return w
  w = _reshard(w, P(), mesh)
  if set(mesh.axis_names) - set(mesh.explicit_axes) - set(mesh.manual_axes):   # Auto axes
    w = lax.with_sharding_constraint(w, jax.sharding.NamedSharding(mesh, P()))
  return w


def reduce_stats(st: stats_lib.FFNStats, axes) -> stats_lib.FFNStats:
  """Per-device stats -> the stats of the whole batch (equal shards of the tokens), inside
  `shard_map` over `axes`; any leading axes (layers, micro-batches) are kept.

  Only l1 is differentiable; the counters pass through `stop_gradient` first, because a custom
  VJP's integer outputs carry instantiated zero tangents and `pmax` has no JVP rule.
  """
  count = lambda a: lax.stop_gradient(a)
  return stats_lib.FFNStats(
      l1=lax.pmean(st.l1, axes),
      nnz_per_token=lax.pmean(count(st.nnz_per_token), axes),
      max_tile_nnz=lax.pmax(count(st.max_tile_nnz), axes),
      overflow_rows=lax.psum(count(st.overflow_rows), axes),
      feature_counts=lax.psum(count(st.feature_counts), axes),
      heavy_rows_by_hot=lax.psum(count(st.heavy_rows_by_hot), axes),
      implementation=st.implementation)


def ffn(x, w_gate, w_up, w_down, *, return_stats: bool = False, **kwargs):
  """`twell_jax.ffn` with each device of the mesh in context working on its own tokens.

  Args:
    x, w_gate, w_up, w_down: as for `twell_jax.ffn` (x [..., D]; the weights whole or
      sharded any way: they are gathered for the call).
    return_stats: also return the `FFNStats` of the whole batch.
    **kwargs: `twell_jax.ffn`'s keyword arguments (activation, implementation, interpret,
      ell_width, tail_rows, hot_features).

  Returns:
    What `twell_jax.ffn` returns for the same arguments, up to the rounding of sums split
    over devices.
  """
  mesh = jax.sharding.get_abstract_mesh()
  shape, x_spec = tuple(x.shape), _spec_of(x)
  axes = split_axes(shape[0], mesh) if x.ndim >= 2 else ()
  if axes:
    x = _reshard(x, P(axes), mesh)
  elif x.ndim >= 2:
    axes = split_axes(math.prod(shape[:-1]), mesh)
    if axes:   # the leading axis does not divide over the devices; the tokens do
      x = _reshape(x, (-1, shape[-1]), P(axes), mesh)
  if not axes:   # no split: the unsharded call (under a mesh, on whole operands)
    whole = lambda a: _reshard(a, P(), mesh)
    out = api.ffn(whole(x), whole(w_gate), whole(w_up), whole(w_down),
                  return_stats=return_stats, **kwargs)
    y, st = out if return_stats else (out, None)
    y = _reshard(y, x_spec, mesh)
    return (y, st) if return_stats else y
  weights = (w_up, w_down) if w_gate is None else (w_gate, w_up, w_down)
  weights = tuple(_reshard(w, P(), mesh) for w in weights)

  def local(x, *ws):
    wg, wu, wd = (None, *ws) if w_gate is None else ws
    y, st = api.ffn(x, wg, wu, wd, return_stats=True, **kwargs)
    return y, reduce_stats(st, axes)

  y, st = jax.shard_map(
      local, mesh=mesh, in_specs=(P(axes),) + (P(),) * len(weights),
      out_specs=(P(axes), P()), axis_names=frozenset(axes),
      check_vma=False)(x, *weights)
  y = _reshape(y, shape, x_spec, mesh) if y.ndim != len(shape) else _reshard(y, x_spec, mesh)
  return (y, st) if return_stats else y
