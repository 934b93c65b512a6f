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
import re
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import optax

from twell_jax import sharded

MESH_AXES = ("data", "fsdp")


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
  opt = optax.tree_utils.tree_map_params(
      tx, lambda _, s: s, state["opt_state"], moments,
      transform_non_params=lambda _: replicated, is_leaf=is_leaf)
  out = {k: jax.tree.map(lambda _: replicated, v) for k, v in state.items()}
  return {**out, "params": params, "opt_state": opt}


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


_COLLECTIVE = re.compile(
    r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
  """The collectives of a compiled HLO module's text: [(kind, [(dtype, result shape)])], one
  entry per op (an async start / done pair counts once; a combined op lists each operand)."""
  out = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if m and " = " in line[:m.start()]:
      result = line[line.index(" = ") + 3:m.start()]
      shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
                for dt, dims in _SHAPE.findall(result)]
      out.append((m.group(1), shapes))
  return out


_CALLED = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations)=\{?([^}]*?)\}?(?:,\s[a-z_]+=|$)")


def loop_collectives(hlo_text: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
  """The collectives of `collectives(hlo_text)` that run inside a while loop's body (or in a
  computation it calls): those a step repeats once per iteration."""
  bodies, calls, lines, name = set(), {}, {}, None
  for line in hlo_text.splitlines():
    if _COMPUTATION.match(line) and not line.startswith(" "):
      name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      calls[name], lines[name] = set(), []
      continue
    if name is None:
      continue
    lines[name].append(line)
    bodies.update(m.lstrip("%") for m in re.findall(r"\bbody=(%?[\w.\-]+)", line))
    for group in _CALLED.findall(line):
      calls[name].update(c.strip().lstrip("%") for c in group.split(",") if c.strip())
  inside, todo = set(), list(bodies)
  while todo:
    c = todo.pop()
    if c in inside or c not in calls:
      continue
    inside.add(c)
    todo.extend(calls[c])
  return collectives("\n".join(l for c in sorted(inside) for l in lines[c]))


def _weight_shapes(param_shapes, fsdp: int = 1, devices: int = 1) -> set:
  """A parameter's shape, of a stacked one its layer slice (with and without the axis), its
  shards (one axis divided by `fsdp`, the parameters' split, or by `devices`, the optimizer
  moments' and gradients' split: what an all-gather starts from and a reduce-scatter ends
  with), and the transposes of the matrices (XLA may reduce a gradient in the transposed
  layout)."""
  shapes = set()
  for s in map(tuple, param_shapes):
    shapes |= {s, s[1:], (1,) + s[1:]}
  shapes |= {s[:i] + (s[i] // n,) + s[i + 1:] for s in list(shapes) for n in {fsdp, devices}
             if n > 1 for i in range(len(s)) if s[i] % n == 0}
  return shapes | {s[::-1] for s in shapes if len(s) == 2}


def non_weight_collectives(found, param_shapes, fsdp: int = 1, devices: int = 1
                           ) -> list[tuple[str, str, tuple[int, ...]]]:
  """The collectives of `found` (from `collectives`) that move something other than a weight,
  its gradient or their shards (`fsdp`: the mesh's fsdp size; `devices`: its device count,
  over which the optimizer moments and the gradients are split): [(kind, dtype, shape)].

  Every all-to-all and collective-permute, and each all-gather, all-reduce or reduce-scatter
  operand that is not shaped like a parameter; all-reduces of scalars and vectors, and of
  integers (the statistics and counters) pass. Meaningful where no activation has a
  parameter's shape.
  """
  weights = _weight_shapes(param_shapes, fsdp, devices)
  bad = []
  for kind, operands in found:
    for dtype, shape in operands:
      shape = tuple(shape)
      if kind in ("all-to-all", "collective-permute"):
        bad.append((kind, dtype, shape))
      elif not (kind == "all-reduce" and (len(shape) <= 1 or dtype[0] in "su")) and (
          shape not in weights):
        bad.append((kind, dtype, shape))
  return bad


_ASYNC_START = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = .*?\s((?:all-gather|all-reduce|reduce-scatter|"
                          r"all-to-all|collective-permute)-start|async-start)\(")
_ASYNC_DONE = re.compile(r"\s(?:[a-z-]+-done|async-done)\(.*?%([^\s,)]+)")
_KINDS = re.compile(r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute")
_COMPUTE = re.compile(r"\s(fusion|custom-call|call|dot|convolution|while|conditional)\(")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?\S+\s.*\{\s*$")
_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
                "pred": 1, "f64": 8, "s64": 8, "u64": 8}


def collective_overlap(hlo_text: str) -> list[dict]:
  """Each asynchronous collective of a compiled (scheduled) module's entry computation, in
  schedule order: {"kind", "bytes" (what it produces), "between"}, `between` counting the
  compute instructions (fusions, custom calls, command buffers, dots) scheduled between its
  start and its done: the work it can overlap. A collective with `between == 0` is waited for as soon as it is
  issued. Synchronous collectives are not listed (`collectives` lists every one)."""
  entry, inside = [], False
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m and not line.startswith(" "):
      inside = bool(m.group(1))
      continue
    if inside:
      if line.startswith("}"):
        break
      entry.append(line)
  open_ops, out = {}, []
  for line in entry:
    m = _ASYNC_START.match(line)
    if m:
      kind = m.group(2).removesuffix("-start")
      if kind == "async":
        # A generic async pair wraps a computation named after its collective.
        found = _KINDS.search(line[line.index("async-start("):])
        kind = found.group(0) if found else "async"
      result = line[line.index(" = ") + 3:line.index(m.group(2) + "(")]
      if kind == "all-reduce" and result.startswith("(("):
        # ((operands), results...) (the GPU's schedule in jax 0.11): the results only.
        result = result[result.index(")") + 1:]
      sizes = [math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dt, 4)
               for dt, dims in _SHAPE.findall(result)]
      # An all-reduce's result lists each combined operand; another start's tuple holds its
      # operand and its (largest) result.
      nbytes = sum(sizes) if kind == "all-reduce" else max(sizes, default=0)
      open_ops[m.group(1)] = {"kind": kind, "bytes": nbytes, "between": 0}
      continue
    m = _ASYNC_DONE.search(line)
    if m and m.group(1) in open_ops:
      out.append(open_ops.pop(m.group(1)))
      continue
    if _COMPUTE.search(line):
      for op in open_ops.values():
        op["between"] += 1
  return out

