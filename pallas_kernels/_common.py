"""Helpers shared by the Mosaic GPU kernels of this package.

* ``num_sms()``: SM count of the current device, or of the abstract mesh's device (so the
  persistent kernels also trace on the CPU under interpret mode).
* ``interpret_context(interpret)``: the context in which a kernel built with
  ``plgpu.InterpretGPUParams`` runs on the CPU (an abstract H100-like device with 8 SMs).
* ``arrange_interpreter_threads()``: enough XLA CPU threads for the interpreter (run when the
  package is imported).
* ``prefetched_fori_loop`` and the slot helpers: the software-pipelined entry walk of the
  row / column gather kernels.
* ``round_up`` / ``pad_to``: the zero padding that makes any M, D, H legal (zero weights and
  zero rows never fire, so padding is exact).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os

import jax
from jax import lax
import jax.numpy as jnp
from jax.extend import backend

# One TwELL tile spans 256 hidden columns (reference-brief 1.1).
TILE_N = 256
# The stored value of an unused slot: larger than every packed (col << 16 | bf16 bits) word.
EMPTY_WORD = 0x7FFFFFFF


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
  entry to one counter, and those colliding atomics took 0.013 ms at M = 16384 (H100)."""
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


def check_triton_warps(num_warps: int) -> None:
  """ValueError unless ``num_warps`` is a Triton program's warp count."""
  if num_warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"{num_warps=} must be 1, 2, 4, 8 or 16")


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


# SM count of the abstract device the interpreter runs kernels on (see interpret_context).
_INTERPRET_SMS = contextvars.ContextVar("interpret_sms", default=None)


def num_sms() -> int:
  abstract_device = jax.sharding.get_abstract_mesh().abstract_device
  if abstract_device is not None and abstract_device.num_cores:
    return abstract_device.num_cores
  if (interpret_sms := _INTERPRET_SMS.get()) is not None:
    return interpret_sms
  dev = backend.get_default_device()
  return getattr(dev, "core_count", None) or 132


def on_hopper() -> bool:
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  if dev.platform != "gpu":
    return False
  kind = dev.device_kind
  if "H100" in kind or "H200" in kind or "H800" in kind or "GH200" in kind:
    return True
  return getattr(dev, "compute_capability", "") in ("9.0", "9.0a")


@contextlib.contextmanager
def interpret_context(interpret: bool, num_cores: int = 8):
  """An abstract GPU device for the SM-count lookups when interpreting on the CPU.

  Inside shard_map the abstract mesh is the (CPU) mesh being mapped over, which must stay
  in place; there `num_cores` reaches `num_sms` through a context variable instead.
  """
  if not interpret:
    yield
    return
  if jax.sharding.get_abstract_mesh().abstract_device is not None:
    token = _INTERPRET_SMS.set(num_cores)
    try:
      yield
    finally:
      _INTERPRET_SMS.reset(token)
    return
  mesh = jax.sharding.AbstractMesh(
      (), (),
      abstract_device=jax.sharding.AbstractDevice(
          device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=num_cores))
  with jax.sharding.use_abstract_mesh(mesh):
    yield


# The Mosaic GPU interpreter runs each warpgroup of a CTA as an XLA CPU computation of its own,
# and a warpgroup waiting at a barrier for another blocks the XLA CPU thread that runs it. XLA
# sizes that thread pool once, when JAX's CPU client starts: from PJRT_NPROC, else NPROC, else
# the cores this process may run on. With fewer threads than a kernel has warpgroups waiting
# on each other (the gate kernel has 3, plus the thread of the computation that launched them)
# the kernel never finishes: any 2-core machine. 3 measured enough, 2 hung; the pool is given
# 8 for a margin, and fewer than 4 is refused.
INTERPRETER_THREADS = 8
MIN_INTERPRETER_THREADS = 4


def _cpu_pool_threads() -> int:
  """The size XLA gives its CPU thread pool in this environment (PJRT_NPROC, NPROC, cores)."""
  for name in ("PJRT_NPROC", "NPROC"):
    value = os.environ.get(name, "")
    if value.strip().isdigit():
      return int(value)
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # not Linux
    return os.cpu_count() or 1


def _cpu_client_started() -> bool:
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return xla_bridge.backends_are_initialized()


def arrange_interpreter_threads() -> bool:
  """Gives XLA's CPU thread pool the interpreter's `INTERPRETER_THREADS` when the machine has
  fewer cores, by setting PJRT_NPROC before JAX's CPU client starts (importing
  ``pallas_kernels`` or ``twell_jax`` does this). Nothing changes where PJRT_NPROC or NPROC is
  set, the cores suffice, or the client already runs. Returns whether it set PJRT_NPROC."""
  if _cpu_pool_threads() >= INTERPRETER_THREADS or _cpu_client_started():
    return False
  os.environ["PJRT_NPROC"] = str(INTERPRETER_THREADS)
  return True


def check_interpreter_threads() -> None:
  """RuntimeError, in place of a kernel that would never finish, where JAX's CPU client runs
  with too few threads for the interpreter (`arrange_interpreter_threads`)."""
  threads = _cpu_pool_threads()
  if threads < MIN_INTERPRETER_THREADS and _cpu_client_started():
    raise RuntimeError(
        f"the Mosaic GPU interpreter needs {MIN_INTERPRETER_THREADS} or more XLA CPU threads and "
        f"JAX's CPU client started with {threads} (this machine's cores): its kernels would "
        "wait forever. Import twell_jax (or pallas_kernels) before the first JAX computation, "
        f"or set PJRT_NPROC={INTERPRETER_THREADS} in the environment.")


def interpret_params(interpret, detect_races: bool = False):
  """Maps ``interpret`` (bool or InterpretGPUParams) to the ``interpret=`` kernel argument."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if interpret is False or interpret is None:
    return False
  check_interpreter_threads()
  if interpret is True:
    return plgpu.InterpretGPUParams(detect_races=detect_races)
  return interpret


def prefetched_fori_loop(n_steps, load, step, init, *, fetch=None, fetch_ahead=False):
  """``fori_loop`` over steps whose scalar index loads run one step ahead.

  ``load(i)`` issues the (cheap, scalar) GMEM loads step i needs, e.g. the column indices and
  coefficients of a group of sparse entries, and must clamp its indices so that ``load(n_steps)``
  is a harmless in-bounds read; ``step(i, loaded, state)`` does the dependent work (weight-row
  loads, math). Loading step i + 1's indices before step i's weight rows takes one L2 round
  trip off each step's dependency chain.

  With ``fetch``, ``fetch(loaded)`` issues the row loads of a step from its scalars and
  ``step(i, loaded, fetched, state)`` gets them: at the start of step i by default, or, with
  ``fetch_ahead``, one step ahead: step i + 1's rows are issued before step i's work and step
  i + 2's scalars before that (``load`` must then be harmless at n_steps + 1 too), so one
  step's rows are in flight while the step before computes and stores. The reasoning: a warp
  issues in order, and the compiler does not move a row load above a GMEM store of the step
  before it (it cannot prove that they do not alias). The price: a second step's rows in
  registers. Measured on an H100: a few percent on the row kernels at group 1,
  nothing on the column dh kernel, slower weight gradients.
  """
  if fetch is not None and not fetch_ahead:
    inner = step
    step = lambda i, cur, state: inner(i, cur, fetch(cur), state)
  if fetch is None or not fetch_ahead:
    def body(i, carry):
      state, cur = carry
      nxt = load(i + 1)
      return step(i, cur, state), nxt

    state, _ = lax.fori_loop(0, n_steps, body, (init, load(0)))
    return state

  def body_ahead(i, carry):
    state, cur, cur_rows, nxt = carry
    nxt_rows = fetch(nxt)
    nxt2 = load(i + 2)
    return step(i, cur, cur_rows, state), nxt, nxt_rows, nxt2

  first = load(0)
  state, *_ = lax.fori_loop(0, n_steps, body_ahead, (init, first, fetch(first), load(1)))
  return state


def group_slots(step, group: int, last: int) -> list:
  """Slot indices of the `group` ELL entries of step `step`, clamped to `last` (so that the
  one-step-ahead loads of ``prefetched_fori_loop`` stay in bounds)."""
  return [jnp.minimum(step * group + q, last) for q in range(group)]


def column_slots(start, end, step, group: int, last: int):
  """CSC entry indices of the `group` entries of step `step` of a column [start, end), clamped
  to `last` (in bounds for the one-step-ahead loads), and whether each is inside the column."""
  es = [start + step * group + q for q in range(group)]
  return [jnp.minimum(e, last) for e in es], [e < end for e in es]


def gather_kernel_params():
  """Compiler params of the row / column gather kernels (Lane semantics, GMEM only).

  Pallas puts a warpgroup barrier before and after every ref store unless told not to
  (``unsafe_no_auto_barriers``); the per-entry scalar stores of the training kernels (u, du,
  dg) then cost two ``bar.sync`` each. The barriers are not needed here: these kernels never
  read a location they (or another thread) write (outputs are write-only, inputs read-only),
  they use no SMEM and no async copies, which are the two conditions Pallas documents for
  turning them off safely.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                              unsafe_no_auto_barriers=True)


ROW_MODES = ("f32", "bf16", "reload")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherConfig:
  """Tuned choices of a row / column gather kernel; every choice gives the same bits.

  group: entries processed side by side per step (``group`` row loads in flight before the
    first reduction; more registers).
  rows_ahead: the next step's gathered rows are loaded before this step's work
    (``prefetched_fori_loop(fetch_ahead=True)``): rows in flight during the stores, at the
    price of a second step's rows in registers.
  row_mode: where the row that every entry of a row kernel uses (x_r, dy_r) lives
    (``hold_row``).
  """
  group: int = 1
  rows_ahead: bool = False
  row_mode: str = "f32"

  def __post_init__(self):
    if self.group < 1:
      raise ValueError(f"{self.group=} must be >= 1")
    if self.row_mode not in ROW_MODES:
      raise ValueError(f"{self.row_mode=} must be one of {ROW_MODES}")


def hold_row(ref, r, mode: str):
  """A GMEM row that a gather kernel uses at every entry (x_r, dy_r), held per ``mode``:
  "f32" in registers as f32 (D/128 registers per thread), "bf16" in registers as stored (half
  as many; widened at each use), "reload" not held (read again, an L1 hit, at each use: no
  registers across entries, so more CTAs fit on an SM). Use the result through ``row_at``.
  """
  if mode not in ROW_MODES:
    raise ValueError(f"row mode {mode!r} must be one of {ROW_MODES}")
  if mode == "reload":
    return None
  row = ref[r, :]
  return row.astype(jnp.float32) if mode == "f32" else row


def row_at(held, ref, r):
  """The row held by ``hold_row`` as f32 at its point of use (same values in every mode)."""
  if held is None:
    return ref[r, :].astype(jnp.float32)
  return held.astype(jnp.float32)


def zeros_like_row(row):
  """f32 zeros in the register layout of a loaded row (exact even if the row holds inf/nan)."""
  return lax.bitcast_convert_type(
      lax.bitcast_convert_type(row.astype(jnp.float32), jnp.int32) & 0, jnp.float32)

