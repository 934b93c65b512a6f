"""The software-pipelined entry walk of the row / column gather kernels
(``ell_up_down_mgpu``, ``sparse_backward_mgpu``, ``dense_rows_mgpu``): ``prefetched_fori_loop``,
the slot helpers, ``GatherConfig`` and how a gathered weight row is held."""

from __future__ import annotations

import dataclasses

from jax import lax
import jax.numpy as jnp


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

