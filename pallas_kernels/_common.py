"""The TwELL tile and the array helpers every kernel of this package shares.

* ``TILE_N``, ``EMPTY_WORD``, ``tile_max``, ``heavy_rows_by_tile``: the tile layout and the
  per-tile statistics the kernels report.
* ``round_up`` / ``pad_to``: the zero padding that makes any M, D, H legal (zero weights and
  zero rows never fire, so padding is exact).
* ``call_kernel``, ``vary_together``, ``zeros_varying_like``: kernel outputs typed like their
  inputs under shard_map.
* ``jit_kernel_entry``: kernel entries jitted, and their Mosaic GPU modules named alike in every
  lowering, so that a process compiles each kernel once (``stable_kernel_ids``).

The device a kernel targets is in ``_target``, the gather kernels' entry walk in ``_row_loops``.
"""

from __future__ import annotations


import functools

import jax
from jax import lax
import jax.numpy as jnp

# One TwELL tile spans 256 hidden columns (reference-brief 1.1).
TILE_N = 256
# The stored value of an unused slot: larger than every packed (col << 16 | bf16 bits) word.
EMPTY_WORD = 0x7FFFFFFF


def take_rows(a, index):
  """a[index] along axis 0, with the rows of out-of-range indices (the padding value, a.shape[0])
  set to zero: the gather of a row list padded to a static length."""
  rows = jnp.take(a, jnp.minimum(index, a.shape[0] - 1), axis=0)
  return jnp.where((index < a.shape[0])[:, None], rows, jnp.zeros((), a.dtype))


def tile_max(active):
  """Most True entries in one 256-column tile of one row of ``active`` [M, N], as int32 (0 when
  the array is empty)."""
  m, n = active.shape
  if m == 0 or n == 0:
    return jnp.zeros((), jnp.int32)
  active = pad_to(active, (m, round_up(n, TILE_N)))
  return jnp.max(jnp.sum(active.reshape(m, -1, TILE_N), axis=-1, dtype=jnp.int32))


def heavy_rows_by_tile(tile_counts, width: int, slots: int = TILE_N // 8, heavy=None):
  """[T] int32 from each row's active count per 256-column tile (``tile_counts`` [T, M]):
  entry t counts the rows whose actives in tiles t, t + 1, ... exceed ``width``, or that hold
  more than ``slots`` in one of those tiles: the rows that the sparse training kernels send to
  their dense tail when the first 256 t features run as dense GEMMs (hot features). ``heavy``
  [M] bool: rows counted at every t (known heavy from tiles not given)."""
  flip = lambda a: jnp.flip(a, axis=0)
  past = flip(jnp.cumsum(flip(tile_counts), axis=0, dtype=jnp.int32))
  over = flip(lax.cummax(flip((tile_counts > slots).astype(jnp.int32)), axis=0)) > 0
  rows = (past > width) | over
  if heavy is not None:
    rows = rows | heavy[None, :]
  return jnp.sum(rows, axis=1, dtype=jnp.int32)


def first_true(mask, size: int, fill: int):
  """Indices of the first ``size`` True entries of the 1-D ``mask`` (int32), ``fill`` after
  them: ``jnp.nonzero(mask, size=size, fill_value=fill)``, but as a scatter in which only
  True entries write (each to its own slot). jnp.nonzero's scatter-add sends every False
  entry to one counter, where the colliding atomics serialize."""
  n = mask.shape[0]
  pos = jnp.arange(n, dtype=jnp.int32)
  rank = jnp.cumsum(mask, dtype=jnp.int32) - 1          # in [0, n): distinct for True entries
  # True entries past `size`, and every False entry (sent to its own index >= n), are out of
  # bounds and dropped; all indices stay distinct, as unique_indices promises.
  at = jnp.where(mask, rank, n + pos)
  return jnp.full((size,), fill, jnp.int32).at[at].set(pos, mode="drop", unique_indices=True)


def round_up(a: int, b: int) -> int:
  return -(-a // b) * b


def is_pow2(n: int) -> bool:
  return n >= 1 and not n & (n - 1)


def pow2_at_least(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= n and >= minimum (Triton's block sizes are powers of two;
  its dot wants 16 or more rows)."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def zeros_varying_like(shape, dtype, *like):
  """Zeros that vary over every manual mesh axis any of ``like`` varies over (shard_map).

  Inside shard_map a value's type includes the mesh axes it varies over, and the branches
  of a ``lax.cond`` / ``lax.switch``, a scan carry and a custom VJP's cotangents must agree
  on it. ``zeros_like`` keeps its argument's axes without reading its values; outside
  shard_map this is plain zeros.
  """
  like = [a for a in like if a is not None]
  if not like:
    return jnp.zeros(shape, dtype)
  return sum(jnp.zeros_like(a, shape=shape, dtype=dtype) for a in like).astype(dtype)


def vary_together(*arrays):
  """``arrays`` (None kept) typed to vary over the union of their manual mesh axes.

  A custom VJP's backward must return each cotangent with its input's type. When x varies
  over a shard_map axis and the weights do not (data parallel), the weight gradients
  computed from x vary too; casting the weights to vary like x before the custom VJP lets
  JAX's transpose of that cast sum them over the axis, outside the rule and outside any
  conditional. Adds zeros (folded by XLA).
  """
  return tuple(None if a is None else a + zeros_varying_like(a.shape, a.dtype, *arrays)
               for a in arrays)


def call_kernel(kernel, *args):
  """``kernel(*args)`` with its outputs typed to vary like its inputs.

  A Pallas kernel's outputs are typed from its ``out_type``, which names no mesh axes, so
  inside shard_map they would look invariant across devices although each device computes
  its own; code that mixes them with XLA values (a ``lax.switch`` over a dense path) then
  fails to type-check.
  """
  return jax.tree.map(lambda o: o + zeros_varying_like(o.shape, o.dtype, *args),
                      kernel(*args))


def pad_to(a, shape):
  """``a`` zero-padded at the end of each axis to ``shape`` (None stays None)."""
  if a is None or tuple(a.shape) == tuple(shape):
    return a
  return jnp.pad(a, [(0, s - t) for s, t in zip(shape, a.shape)])


_KERNEL_PREFIX = "twell_"
_DUMP_NAME_ATTR = "mosaic_gpu.dump_basename"


def stable_kernel_ids() -> None:
  """Makes each of this package's Mosaic GPU kernels lower to the same bytes in every program.

  jaxlib compiles a Mosaic GPU kernel once per process per kernel hash (the SHA-256 of the
  serialized module: its in-process kernel cache), but Mosaic GPU stamps every module it
  lowers with a dump name ending in a process-wide counter (``mosaic_gpu.dump_basename``,
  "twell_gate_pack_7"), so the same kernel lowered into a second program hashes differently
  and compiles again: each train step built for a new per-layer choice would compile every
  kernel anew, most of its build time. Before serialization the stamp of a module named
  ``twell_*`` is set to the module's own name; the name only matters to Mosaic GPU's
  debugging dumps, where identical kernels now share one file. Idempotent; a no-op where
  jax's Mosaic GPU lowering has no such pass."""
  try:
    from jax.experimental.mosaic.gpu import core  # pylint: disable=import-outside-toplevel
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  serialize = getattr(core, "_run_serde_pass", None)
  if serialize is None or getattr(serialize, "stable_kernel_ids", False):
    return

  def run_serde_pass(module, *args, **kwargs):
    attrs = module.operation.attributes
    if "sym_name" in attrs and _DUMP_NAME_ATTR in attrs:
      name = ir.StringAttr(attrs["sym_name"]).value
      if name.startswith(_KERNEL_PREFIX):
        attrs[_DUMP_NAME_ATTR] = ir.StringAttr.get(name, context=module.context)
    return serialize(module, *args, **kwargs)

  run_serde_pass.stable_kernel_ids = True
  core._run_serde_pass = run_serde_pass  # pylint: disable=protected-access


def jit_kernel_entry(static_argnames):
  """Decorates a kernel's entry to run under ``jax.jit`` with ``static_argnames`` (hashable
  shapes and configs): every call of one shape then traces to one jaxpr, so a train step
  lowers and compiles the kernel once for all the layers that share it. Calls with
  ``interpret`` set run the entry as it is: the Mosaic GPU interpreter's state does not
  survive a cached executable run again. Also makes the kernels'
  modules the same bytes in every program (``stable_kernel_ids``)."""
  stable_kernel_ids()

  def decorate(entry):
    jitted = jax.jit(entry, static_argnames=static_argnames)

    @functools.wraps(entry)
    def call(*args, **kwargs):
      return (entry if kwargs.get("interpret") else jitted)(*args, **kwargs)
    return call
  return decorate
