"""The trainer's device mesh and how its state and batches are laid out on it.

Mesh (config `mesh`): axes ("data", "fsdp") over every device of every process, sizes from
`mesh.data` and `mesh.fsdp`, -1 taking the devices the other axis leaves. A tensor-parallel
axis would be a third, innermost axis: the model's FFN runs under `jax.shard_map` over the
batch axes only (`twell_jax.sharded`) and leaves other axes to GSPMD.

- Batches are split over ("data", "fsdp") along the batch axis: every device holds distinct
  sequences, FSDP devices included.
- Parameters (FSDP, as in MaxText and levanter): each array of rank >= 2 is split over
  "fsdp" along its largest axis that the fsdp size divides (the earlier one on ties; the
  stacked layer axis of the scan layout is never split), and replicated over "data". Vectors
  (the RMSNorm scales) and arrays with no such axis are replicated. With fsdp = 1 every
  parameter is replicated: plain data parallelism.
- Optimizer state (AdamW's moments, which have the parameters' shapes) is split over every
  mesh axis of more than one device, "data" included, along the largest axis that the
  product of their sizes divides (`mesh.shard_optimizer`, off by default; ZeRO stage 1): each
  device keeps and updates 1/N of the moments, and the step gathers the updated parameters
  back onto every device that holds them (f32). Off, the moments follow the parameters. The
  optimizer's counters, the step, the RNG and the dead-feature counters are replicated.
- Gradients are constrained to the moments' sharding inside the step: each device sums
  and updates only its slice (XLA turns the reduction and the slice into a reduce-scatter,
  half the bytes of an all-reduce).

Each process feeds the rows of the devices it owns (`jax.make_array_from_process_local_data`);
the mesh lists devices in process order, so a process's rows are one contiguous block of the
global batch.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import optax

from twell_jax import sharded

MESH_AXES = ("data", "fsdp")

# config `mesh.gradient_reduction`: "per_device" (and "auto" without fsdp) reduces the gradients
# once after the backward, "gspmd" lets XLA reduce them inside it (`train.state.steps`).
GRADIENT_REDUCTIONS = ("auto", "per_device", "gspmd")


class MeshError(ValueError):
  """Mesh sizes that do not fit the devices."""


def mesh_shape(mesh_cfg, n_devices: int) -> dict[str, int]:
  """{axis: size} of the config's mesh on `n_devices` devices (-1 filled in)."""
  sizes = {a: int((mesh_cfg or {}).get(a, -1 if a == "data" else 1)) for a in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise MeshError(f"at most one mesh axis may be -1; got {sizes}")
  if any(s == 0 or s < -1 for s in sizes.values()):
    raise MeshError(f"mesh sizes must be positive or -1; got {sizes}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if n_devices % fixed:
      raise MeshError(f"mesh {sizes}: {n_devices} devices are not divisible by {fixed}")
    sizes[free[0]] = n_devices // fixed
  if math.prod(sizes.values()) != n_devices:
    raise MeshError(f"mesh {sizes} needs {math.prod(sizes.values())} devices; there are "
                    f"{n_devices}")
  return sizes


def make_mesh(mesh_cfg=None, devices=None) -> jax.sharding.Mesh:
  """The ("data", "fsdp") mesh of `mesh_cfg` over `devices` (default: all devices)."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(mesh_cfg, len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def param_spec(shape: tuple[int, ...], fsdp: int, *, stacked: bool = False) -> P:
  """The PartitionSpec of a parameter of `shape` (see the module docstring)."""
  first = 1 if stacked else 0
  if fsdp == 1 or len(shape) - first < 2:
    return P()
  axes = [i for i in range(first, len(shape)) if shape[i] % fsdp == 0]
  if not axes:
    return P()
  best = max(axes, key=lambda i: (shape[i], -i))
  return P(*(("fsdp" if i == best else None) for i in range(len(shape))))


def _stacked(path, scan_layers: bool) -> bool:
  """Whether the params leaf at `path` is stacked over the layers (the scan layout)."""
  return scan_layers and getattr(path[0], "key", None) == "blocks"


def param_shardings(params: Any, mesh: jax.sharding.Mesh, *, scan_layers: bool) -> Any:
  """NamedShardings for a params tree (arrays or ShapeDtypeStructs)."""
  fsdp = mesh.shape.get("fsdp", 1)

  def one(path, p):
    return NamedSharding(mesh, param_spec(tuple(p.shape), fsdp,
                                          stacked=_stacked(path, scan_layers)))

  return jax.tree_util.tree_map_with_path(one, params)


def moment_shardings(params: Any, mesh: jax.sharding.Mesh, *, scan_layers: bool,
                     shard_optimizer: bool = False) -> Any:
  """NamedShardings (a params-shaped tree) of the optimizer's moments and of the gradients
  inside the step: split over every mesh axis of more than one device (see the module
  docstring), or the parameters' own with `shard_optimizer=False`. An array with no axis
  that the devices divide keeps its parameter's sharding."""
  axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
  n = math.prod(mesh.shape[a] for a in axes)
  params_sh = param_shardings(params, mesh, scan_layers=scan_layers)
  if not shard_optimizer or n == 1:
    return params_sh

  # "fsdp" first: a moment's slice lies inside its parameter's fsdp slice (no permutes).
  name = axes[0] if len(axes) == 1 else tuple(sorted(axes, key=lambda a: a != "fsdp"))

  def one(path, p, param_sharding):
    spec = tuple(param_sharding.spec)
    split = [d for d, e in enumerate(spec) if e is not None]
    if split:   # split over fsdp already: the same axis, if the devices divide it
      if p.shape[split[0]] % n:
        return param_sharding
    else:
      spec = tuple(param_spec(tuple(p.shape), n, stacked=_stacked(path, scan_layers)))
      split = [d for d, e in enumerate(spec) if e is not None]
      if not split:
        return param_sharding
    return NamedSharding(mesh, P(*(name if d == split[0] else None
                                   for d in range(len(p.shape)))))

  return jax.tree_util.tree_map_with_path(one, params, params_sh)


def state_shardings(state: Any, tx: optax.GradientTransformation,
                    mesh: jax.sharding.Mesh, *, scan_layers: bool, moments: Any = None) -> Any:
  """NamedShardings for the train state {params, opt_state, step, rng, since}; `moments`
  (from `moment_shardings`) lays out the optimizer's moments, by default like the
  parameters."""
  replicated = NamedSharding(mesh, P())
  params = param_shardings(state["params"], mesh, scan_layers=scan_layers)
  moments = params if moments is None else moments
  is_leaf = lambda x: isinstance(x, NamedSharding)
  # tree_map_params runs the optimizer's init on a placeholder: its scalars (step counts) are
  # made on the host's CPU device, not compiled for the accelerator on the main thread (on a
  # GPU, the compiler's start-up, on the way to a run's first step).
  with jax.default_device(_host_cpu()):
    opt = optax.tree_utils.tree_map_params(
        tx, lambda _, s: s, state["opt_state"], moments,
        transform_non_params=lambda _: replicated, is_leaf=is_leaf)
  out = {k: jax.tree.map(lambda _: replicated, v) for k, v in state.items()}
  return {**out, "params": params, "opt_state": opt}


def _host_cpu():
  """The CPU backend's first device, or None (the default device) where the CPU backend is
  not loaded (`JAX_PLATFORMS=cuda`)."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Train batches [micro-batches, rows, T + 1]: rows split over the batch axes."""
  return NamedSharding(mesh, P(None, sharded.batch_axes(mesh), None))


def eval_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Eval batches [rows, T + 1]."""
  return NamedSharding(mesh, P(sharded.batch_axes(mesh), None))


def traced_in(mesh: jax.sharding.Mesh, fn):
  """`fn` traced with `mesh` as the abstract mesh in context, for jax.jit.

  `twell_jax.sharded` and the loss find the batch axes through the context mesh; the
  jitted function's in/out shardings give the devices.
  """
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return wrapped


def split_count(shardings: Any) -> tuple[int, int]:
  """(how many of a tree's NamedShardings split their array, how many there are)."""
  leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  return sum(any(e is not None for e in s.spec) for s in leaves), len(leaves)


def describe(mesh: jax.sharding.Mesh, shardings: Any, moments: Any = None) -> str:
  """One line: mesh sizes and how many parameter arrays (and, given their shardings, AdamW
  moments) are split."""
  split, total = split_count(shardings)
  line = (f"mesh {dict(mesh.shape)} over {mesh.size} devices of {jax.process_count()} "
          f"processes; {split} of {total} parameter arrays split over fsdp")
  if moments is not None:
    line += f", {split_count(moments)[0]} of their optimizer moments split over the mesh"
  return line
