"""TwELL sparse FFN forward on Hopper with Pallas Mosaic GPU kernels (entry point).

    gated:      h = relu(x @ w_gate) * (x @ w_up);  y = h @ w_down
    non-gated:  h = relu(x @ w_up);                  y = h @ w_down
x [M, D] bf16, w_gate / w_up [D, H] bf16, w_down [H, D] bf16 -> y [M, D] bf16 (f32 accumulation).

Pipeline (two kernel launches plus small XLA glue, all on device, no host sync):
 1. ``gate_pack_mgpu.gate_pack``: wgmma GEMM x @ w_gate (w_up when non-gated) with ReLU and
    TwELL packing in its epilogue (S = 256 / compression slots per row and 256-column tile;
    true counts kept). The dense [M, H] activation is never written.
 2. ``sparse_up_down_mgpu.sparse_up_down``: per row, over the packed entries, gathers W_up^T rows
    (gated) and W_down rows, computes h and accumulates y in f32.
 3. Overflow rows (some tile count > S) are skipped by step 2 and recomputed exactly by a dense
    XLA FFN (``reference.dense_ffn``) on those rows, gathered up to a static capacity R (``overflow_capacity``); if more
    than R rows overflow, a ``lax.switch`` runs the dense XLA FFN on the whole batch instead.
    Nothing is truncated; ``stats["overflow_rows"]`` counts the rows that took a dense path.

Shapes: any M >= 1 (padded to a multiple of 128), D padded to a multiple of 128, H to a multiple
of 256 with zero weights (so padding is exact: zero gate pre-activations are not active).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import _common as common
from pallas_kernels import gate_pack_mgpu
from pallas_kernels import reference
from pallas_kernels import sparse_up_down_mgpu


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardConfig:
  """Static choices of the forward. ``overflow_capacity``: rows the exact dense path for
  overflowing rows holds (None: ``default_overflow_capacity``); more overflowing rows switch
  the whole batch to the dense FFN. ``hot_columns``: K, the batch's most frequent hidden
  features, computed as dense [M, K] GEMMs on the tensor cores; the fused kernel skips their
  entries (0: none). Off by default: on an H100 at the paper shape its glue (a count scatter
  over every slot, marking the words) cost more than the entries it took off the kernel,
  uniform 0.763 -> 0.923 of dense, skewed 0.941 -> 0.992 (K = 128)."""
  overflow_capacity: int | None = None
  hot_columns: int = 0
  gate: gate_pack_mgpu.GateConfig = gate_pack_mgpu.GateConfig()
  up_down: sparse_up_down_mgpu.UpDownConfig = sparse_up_down_mgpu.UpDownConfig()

  def __post_init__(self):
    if self.overflow_capacity is not None and self.overflow_capacity < 1:
      raise ValueError(f"{self.overflow_capacity=} must be >= 1 or None")
    if self.hot_columns < 0:
      raise ValueError(f"{self.hot_columns=} must be >= 0")


def supports(x, w_gate, w_up, w_down, *, interpret: bool = False) -> str | None:
  """None if the kernels can run this call (on the default backend, or in the interpreter), else a reason."""
  if getattr(x, "ndim", None) != 2:
    return f"x must be 2-D [M, D], got shape {getattr(x, 'shape', None)}"
  for name, a in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if a is not None and a.dtype != jnp.bfloat16:
      return f"{name} must be bfloat16, got {a.dtype}"
  m, d = x.shape
  if m < 1:
    return "x must have at least one row"
  if w_up.ndim != 2 or w_up.shape[0] != d:
    return f"w_up must be [D={d}, H], got {w_up.shape}"
  h = w_up.shape[1]
  if w_gate is not None and w_gate.shape != (d, h):
    return f"w_gate must be [D={d}, H={h}], got {w_gate.shape}"
  if w_down.shape != (h, d):
    return f"w_down must be [H={h}, D={d}], got {w_down.shape}"
  if common.round_up(h, common.TILE_N) > 65536:
    return f"H={h} exceeds the 16-bit column field of the packed words"
  if not interpret and not common.on_hopper():
    return "needs a Hopper GPU (sm_90) as the default device, or interpret=True"
  return None


def default_overflow_capacity(m_padded: int) -> int:
  return min(m_padded, common.round_up(max(64, m_padded // 64), 64))


def _dense_rows(x, w_gate, w_up, w_down):
  """(y, |h| row sums, active) of the dense FFN (``reference.dense_ffn``) on rows x."""
  y, h, active = reference.dense_ffn(x, w_gate, w_up, w_down)
  return y, jnp.sum(jnp.abs(h.astype(jnp.float32)), axis=1), active


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def ffn_forward(x, w_gate, w_up, w_down, *, config: ForwardConfig = ForwardConfig(),
                w_up_t=None, interpret=False):
  """TwELL FFN forward. Returns (y [M, D] bf16, stats dict of device arrays).

  ``w_up_t`` optionally passes a pre-transposed [H, D] copy of ``w_up`` (layers can hold one
  to save the transpose). Stats: "l1" (mean over tokens of sum_j |h|), "nnz_per_token",
  "max_tile_nnz", "overflow_rows", "fired" [H] bool.
  """
  if x.ndim != 2:
    raise ValueError(f"x must be [M, D], got shape {x.shape}")
  m, d = x.shape
  if w_up.ndim != 2 or w_up.shape[0] != d:
    raise ValueError(f"w_up must be [D={d}, H], got shape {w_up.shape}")
  h = w_up.shape[1]
  gated = w_gate is not None
  if gated and w_gate.shape != (d, h):
    raise ValueError(f"w_gate must be [D={d}, H={h}], got shape {w_gate.shape}")
  if w_down.shape != (h, d):
    raise ValueError(f"w_down must be [H={h}, D={d}], got shape {w_down.shape}")
  for name, a in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if a is not None and a.dtype != jnp.bfloat16:
      raise ValueError(f"{name} must be bfloat16, got {a.dtype}")

  mp = common.round_up(m, gate_pack_mgpu.CTA_M)
  dp = common.round_up(d, 128)
  hp = common.round_up(h, common.TILE_N)
  compression = config.gate.compression
  slots = common.TILE_N // compression
  n_tiles = hp // common.TILE_N
  cap = min(config.overflow_capacity or default_overflow_capacity(mp), mp)

  pad = common.pad_to
  xp = pad(x, (mp, dp))
  wup_p = pad(w_up, (dp, hp))
  wd_p = pad(w_down, (hp, dp))
  wg_p = pad(w_gate, (dp, hp)) if gated else None
  if gated:
    wup_t = pad(w_up_t, (hp, dp)) if w_up_t is not None else wup_p.T
  else:
    wup_t = None

  words, counts = gate_pack_mgpu.gate_pack(xp, wg_p if gated else wup_p, config=config.gate,
                                           interpret=interpret)
  cnt = counts.reshape(mp, n_tiles, common.COUNT_LANES)[..., 0]
  valid_row = jnp.arange(mp) < m
  row_over = jnp.any(cnt > slots, axis=1) & valid_row
  n_over = jnp.sum(row_over.astype(jnp.int32))
  row_ok = jnp.logical_not(row_over).astype(jnp.int32)

  w3 = words.reshape(mp, n_tiles, slots)
  live = row_ok.astype(bool) & valid_row
  slot_ok = ((jnp.arange(slots)[None, None, :] < cnt[..., None]) & live[:, None, None])
  col = ((w3 >> 16) & (common.TILE_N - 1)) + (jnp.arange(n_tiles) * common.TILE_N)[None, :, None]
  col = jnp.where(slot_ok, col, hp)
  k_hot = min(config.hot_columns, hp)

  def sparse_path(fix: bool):
    if k_hot:
      # Entries per hidden column (a scatter of every slot: ~0.08 ms at the paper shape on an
      # H100); the K most frequent columns run as dense GEMMs and the kernel skips them.
      col_count = jnp.zeros((hp,), jnp.int32).at[col.reshape(-1)].add(1, mode="drop")
      hot = lax.top_k(col_count, k_hot)[1].astype(jnp.int32)
      is_hot = jnp.zeros((hp + 1,), bool).at[hot].set(True)
      marked = jnp.where(is_hot[col], w3 | common.SKIP_BIT, w3).reshape(mp, -1)
      y_hot, _, _, h_hot = reference.dense_ffn_columns(xp, wg_p, wup_p, wd_p, hot, live)
      y, l1_rows = sparse_up_down_mgpu.sparse_up_down(
          xp, marked, counts, row_ok, wup_t, wd_p, compression=compression, y_init=y_hot,
          skips=True, config=config.up_down, interpret=interpret)
      l1_rows = l1_rows + jnp.sum(jnp.abs(h_hot.astype(jnp.float32)), axis=1)
      fired = col_count > 0
    else:
      y, l1_rows = sparse_up_down_mgpu.sparse_up_down(
          xp, words, counts, row_ok, wup_t, wd_p, compression=compression,
          config=config.up_down, interpret=interpret)
      # A scatter of every slot into [H] (an OR-reduction of per-row 256-bit column masks
      # measured the same).
      fired = jnp.zeros((hp,), jnp.bool_).at[col.reshape(-1)].set(True, mode="drop")
    l1_rows = jnp.where(live, l1_rows, 0.0)
    if fix:
      (idx,) = jnp.nonzero(row_over, size=cap, fill_value=mp)
      take = jnp.minimum(idx, mp - 1)
      y_o, l1_o, act_o = _dense_rows(xp[take], wg_p, wup_p, wd_p)
      in_range = (idx < mp)
      y = y.at[idx].set(y_o, mode="drop")
      l1_rows = l1_rows.at[idx].set(l1_o, mode="drop")
      fired = fired | jnp.any(act_o & in_range[:, None], axis=0)
    return y, jnp.sum(l1_rows), fired

  def dense_path():
    y, l1_rows, act = _dense_rows(xp, wg_p, wup_p, wd_p)
    l1_rows = jnp.where(valid_row, l1_rows, 0.0)
    fired = jnp.any(act & valid_row[:, None], axis=0)
    return y, jnp.sum(l1_rows), fired

  branch = jnp.where(n_over == 0, 0, jnp.where(n_over <= cap, 1, 2))
  y, l1_sum, fired = lax.switch(
      branch, [lambda: sparse_path(False), lambda: sparse_path(True), dense_path])

  cnt_valid = jnp.where(valid_row[:, None], cnt, 0)
  stats = {
      "l1": l1_sum / m,
      "nnz_per_token": jnp.sum(cnt_valid).astype(jnp.float32) / m,
      "max_tile_nnz": jnp.max(cnt_valid).astype(jnp.int32),
      "overflow_rows": n_over,
      "fired": fired[:h],
  }
  return y[:m, :d], stats
