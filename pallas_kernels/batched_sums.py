"""Full sums of G warpgroup vectors at once, for the Lane-semantics gather kernels (Hopper).

``jnp.sum`` of a [D] vector to a scalar in a Pallas Mosaic GPU kernel (Lane semantics) costs
a per-thread sum, 5 warp shuffles and a cross-warp exchange through SMEM fenced by two
warpgroup barriers. A kernel that needs G such sums per step (``csc_down_dh``: one dot per CSC
entry, G entries side by side) pays 5 G shuffles and 2 G barriers. ``batched_sums`` computes
all G at once:

  1. each thread sums its own elements of every vector: G scalars per thread, no traffic;
  2. a transposing butterfly over the 32 lanes of each warp: at the step with lane distance m,
     a lane keeps half of its remaining values (the upper half where its lane bit m is set)
     and sends the other half to lane ^ m, which adds it to its own. After log2 G steps
     (G - 1 shuffles in all) lane l holds the 32 / G-lane partial of vector
     q(l) = (l >> (5 - log2 G)) & (G - 1); 5 - log2 G plain butterfly steps finish the warp;
  3. every lane writes its warp's sum for q(l) to ``scratch[warp, q(l)]`` (lanes with the
     same q write the same value), one warpgroup barrier, and every thread reads all 4 G
     partials and adds them in a fixed order.

For G = 8: 9 shuffles and one barrier per 8 sums, against 40 and 16. The results are the
same sums in a different order than ``jnp.sum``'s (not bit-equal to it); the order is fixed,
so results are deterministic.

``scratch`` is an SMEM f32 ref of shape [2, 4 G] (use ``scratch_shape(G)``); call i of a
loop must pass parity i % 2. Why two halves are enough with one barrier per call: call i + 2
writes the half call i read, and every thread passes call i + 1's barrier only after all
threads have finished call i's reads.

The code is raw Mosaic GPU (``plgpu.inline_mgpu``), which has no interpreter rule: kernels
that run in interpret mode sum with ``jnp.sum`` there instead (``csc_down_dh``). Supported: G a power of two with 2 <= G <= 32, vectors [D] f32 in a warpgroup-strided layout
(D % 128 == 0).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector

_WARP = 32
_WARPS = 4


def scratch_shape(group: int):
  """The SMEM scratch ``batched_sums`` needs for ``group`` vectors per call."""
  return plgpu.SMEM((2, _WARPS * group), jnp.float32)


def supported(group: int) -> bool:
  return 2 <= group <= _WARP and group & (group - 1) == 0


def strided_layout(d: int, dtype_bits: int = 16):
  """The warpgroup-strided layout Mosaic GPU gives a loaded [d] row of ``dtype_bits``-bit
  elements (``WGStridedFragLayout.from_shaped_type``: 8-byte vectors, or fewer elements when
  d is small); f32 values converted from such a row keep it."""
  vec = min(64 // dtype_bits, d // 128)
  while vec > 1 and d % (vec * 128):
    vec //= 2
  return plgpu.Layout.WG_STRIDED((d,), vec_size=max(vec, 1))


def batched_sums(vectors, scratch, parity):
  """[sum(v) for v in vectors] as f32 scalars (see the module docstring).

  vectors: G f32 arrays [D] in ``strided_layout(D)``; scratch: the kernel's
  ``scratch_shape(G)`` ref; parity: this call's loop index mod 2 (int32 scalar).
  """
  group = len(vectors)
  if not supported(group):
    raise ValueError(f"batched_sums: {group=} must be a power of two in [2, {_WARP}]")
  (d,) = vectors[0].shape
  layout = strided_layout(d)
  vectors = [plgpu.layout_cast(v, layout) for v in vectors]
  splat = plgpu.ShapeDtypeStruct((), jnp.float32, layout=plgpu.Layout.WG_SPLAT(()))
  fn = plgpu.inline_mgpu(arg_types=((layout,) * group, plgpu.RefType()),
                         return_type=(splat,) * group)(_sums_mgpu)
  return list(fn(tuple(vectors), scratch.at[parity]))


def _sums_mgpu(ctx, vectors, scratch):
  """The Mosaic GPU body of ``batched_sums`` (steps 1-3 of the module docstring)."""
  del ctx
  group = len(vectors)
  f32 = ir.F32Type.get()
  i32 = ir.IntegerType.get_signless(32)
  index = ir.IndexType.get()
  add = arith.addf

  # 1. Per-thread sums (a pairwise tree over the registers: short dependency chains).
  partials = []
  for fa in vectors:
    regs = list(fa.registers.flat)
    while len(regs) > 1:
      regs = [add(a, b) for a, b in zip(regs[::2], regs[1::2])] + regs[len(regs) - len(regs) % 2:]
    (vec_len,) = ir.VectorType(regs[0].type).shape
    elems = [vector.extract(regs[0], dynamic_position=[],
                            static_position=ir.DenseI64ArrayAttr.get([i]))
             for i in range(vec_len)]
    while len(elems) > 1:
      elems = [add(a, b) for a, b in zip(elems[::2], elems[1::2])] + elems[len(elems) - len(elems) % 2:]
    partials.append(elems[0])

  # 2. Transposing butterfly, then plain butterfly steps.
  tid = mgpu_utils.thread_idx()
  lane = arith.remui(tid, mgpu_utils.c(_WARP, i32))
  warp = arith.divui(arith.remui(tid, mgpu_utils.c(_WARP * _WARPS, i32)),
                     mgpu_utils.c(_WARP, i32))
  vals, dist = partials, _WARP // 2
  while len(vals) > 1:
    half = len(vals) // 2
    upper = arith.cmpi(arith.CmpIPredicate.ne,
                       arith.andi(lane, mgpu_utils.c(dist, i32)), mgpu_utils.c(0, i32))
    nxt = []
    for lo, hi in zip(vals[:half], vals[half:]):
      send = arith.select(upper, lo, hi)
      keep = arith.select(upper, hi, lo)
      nxt.append(add(keep, mgpu_utils.shfl_bfly(send, dist)))
    vals, dist = nxt, dist // 2
  (val,) = vals
  while dist >= 1:
    val = add(val, mgpu_utils.shfl_bfly(val, dist))
    dist //= 2

  # 3. Cross-warp: scratch[warp * G + q(lane)], one barrier, everyone reads all 4 G.
  shift = _WARP.bit_length() - 1 - (group.bit_length() - 1)     # 5 - log2 G
  q = arith.andi(arith.shrui(lane, mgpu_utils.c(shift, i32)), mgpu_utils.c(group - 1, i32))
  slot = arith.addi(arith.muli(warp, mgpu_utils.c(group, i32)), q)
  vector.store(vector.broadcast(ir.VectorType.get((1,), f32), val), scratch,
               [arith.index_cast(index, slot)])
  mgpu_utils.warpgroup_barrier()
  stored = vector.load(ir.VectorType.get((_WARPS * group,), f32), scratch,
                       [arith.constant(index, 0)])
  elem = lambda i: vector.extract(stored, dynamic_position=[],
                                  static_position=ir.DenseI64ArrayAttr.get([i]))
  sums = []
  for qq in range(group):
    w = [elem(k * group + qq) for k in range(_WARPS)]
    sums.append(add(add(w[0], w[1]), add(w[2], w[3])))
  return tuple(
      mgpu.FragmentedArray(_registers=np.asarray(s, dtype=object),
                           _layout=mgpu.WGSplatFragLayout(()), _is_signed=None)
      for s in sums)

