"""What a compiled program's HLO text says about its collectives: which there are, which run
inside loops, which move something other than weights, and how much compute each async one
overlaps. For the scaling benchmark and the sharding tests (`train.runtime.mesh` lays out the
state; this reads what XLA made of it)."""

from __future__ import annotations

import math
import re

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

