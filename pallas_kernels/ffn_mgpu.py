"""TwELL sparse FFN forward on Hopper with Pallas Mosaic GPU kernels (entry point).

    gated:      h = relu(x @ w_gate) * (x @ w_up);  y = h @ w_down
    non-gated:  h = relu(x @ w_up);                  y = h @ w_down
x [M, D] bf16, w_gate / w_up [D, H] bf16, w_down [H, D] bf16 -> y [M, D] bf16 (f32 accumulation).

Pipeline (all on device, no host sync):
 0. The first K = ``ForwardConfig.hot_features`` hidden features (the hottest, once the
    features are sorted by popularity) as dense XLA GEMMs; their products start step 2's sums.
 1. ``gate_pack_mgpu.gate_pack``: wgmma GEMM x @ w_gate[:, K:] (w_up when non-gated) with ReLU
    and TwELL packing in its epilogue (S = 256 / compression slots per row and 256-column
    tile; true counts kept). The dense [M, H] activation is never written.
 2. The packed words become ELL rows and the overflow rows a list
    (``twell_to_ell_triton.twell_to_ell``, one kernel: each row's entries in one flat list of
    at most ``max_row_entries``), then ``ell_up_down_mgpu.ell_up_down`` (without u): per
    row, over its entries, gathers W_up^T rows (gated) and W_down rows, computes h and
    accumulates y in f32. A flat list lets the kernel load the next entry's rows while the
    current one computes, across tile borders: on an H100 at the paper shape, uniform 30
    entries per row, 0.563 ms against 0.693 for a walk of the TwELL tiles themselves; the
    conversion costs 0.017-0.018 ms (0.04 ms in 11 XLA kernels).
 3. Overflow rows (some tile count > S, or more than ``max_row_entries`` entries) are skipped
    by step 2's sums and computed exactly by ``dense_rows_mgpu.dense_ffn_rows``, a dense FFN
    on the row list, whose length the kernels read on the device: no conditional, no host
    round trip, and with no overflowing row only its three launches. Step 2 then copies
    those rows' results in. Nothing is truncated; ``stats["overflow_rows"]`` counts them.
    Its buffers hold every row (x, h and y of the whole batch, as XLA's dense FFN does),
    since the count is known only on the device.
NaN and infinities propagate as through the dense FFN: a NaN gate pre-activation is packed as
an active NaN entry (relu(NaN) = NaN), a row with a non-finite x overflows (all its gates are
non-finite) and is recomputed densely, and a non-finite w_up (gated) or w_down sends every row
down the dense path (the dense FFN multiplies it by the zeros of h).

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
from pallas_kernels import _target as target
from pallas_kernels import _row_loops as row_loops
from pallas_kernels import dense_rows_mgpu
from pallas_kernels import ell_up_down_mgpu
from pallas_kernels import gate_pack_mgpu
from pallas_kernels import reference
from pallas_kernels import twell_to_ell_triton


GATE_CHECK_BLOCKS = 2     # ForwardConfig.weight_check="auto": the gate kernel's blocks per tile


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardConfig:
  """Static choices of the forward.

  ``hot_features``: K, a multiple of 256: the first K hidden features run as dense GEMMs on the
    tensor cores (x @ [W_gate | W_up][:, :K], then h @ W_down[:K]) and the gate kernel packs
    only the columns after them. Any K gives the same function; it pays when the first K
    features are the ones that fire on more than about 1% of the tokens (a dense column costs
    what a sparse one costs at that rate: 2 M D FLOPs against 2 D-long row gathers per entry),
    which sorting the hidden features by popularity gives (a permutation of the FFN's hidden
    units, which leaves its function unchanged). Real L1-trained layers have tens to hundreds
    of such features holding 90-99% of all active entries.
  ``max_row_entries``: the ELL width; rows with more packed entries take the dense fix-up
    too: the fused kernel walks a row's entries in one CTA, so a row of hundreds of cold entries (real
    layers have a few near-dense rows) would outlast the whole batch's other rows.
  ``ell``: the fused kernel's choices (``ell_up_down``): each entry's weight rows loaded a step
    ahead, x_r held as f32 (0.563 ms; x_r re-read at each entry: 0.601 ms; H100, uniform).
  ``dense_rows``: the tiles of the dense path for overflowing rows (``dense_rows_mgpu``).
  ``convert``: what turns the TwELL tiles into ELL rows and lists the overflow rows:
    "triton", one kernel (``twell_to_ell_triton``, Pallas' Triton backend: the conversion is
    a per-thread gather, which Mosaic GPU's warpgroup-wide arrays do not express), or "xla",
    ``ell_up_down_mgpu.ell_from_twell`` and a cumulative sum (11 small XLA kernels, 0.04 ms
    against 0.018 at the paper shape on an H100). Same bits either way. jax marks the Triton
    backend deprecated; "xla" is the path for a jax without it.
  ``convert_kernel``: the conversion kernel's schedule.
  ``weight_check``: what looks for a NaN / infinity in w_up (gated) and w_down, which sends
    every row down the dense path: "gate", the gate kernel's packing warpgroup, a block or two
    of each before each tile while the tensor cores run (``gate_pack(check=)``); "xla", a
    reduction of its own over both (``reference.any_nonfinite``); "auto" (the default), "gate"
    where each CTA of the gate kernel reads at most ``GATE_CHECK_BLOCKS`` blocks of each
    array per tile (about M >= 4 D), else "xla": with fewer tiles the kernel's share is read
    one block after another and outlasts the reduction. At the paper shape on an H100 the
    check adds 0.011 ms to the gate kernel and saves the reduction's 0.017 ms and a launch.
  """
  hot_features: int = 0
  max_row_entries: int = 128
  gate: gate_pack_mgpu.GateConfig = gate_pack_mgpu.GateConfig()
  ell: row_loops.GatherConfig = row_loops.GatherConfig(rows_ahead=True, row_mode="f32")
  dense_rows: dense_rows_mgpu.DenseRowsConfig = dense_rows_mgpu.DenseRowsConfig()
  weight_check: str = "auto"
  convert: str = "triton"
  convert_kernel: twell_to_ell_triton.ConvertConfig = twell_to_ell_triton.ConvertConfig()

  def __post_init__(self):
    if self.max_row_entries < 1:
      raise ValueError(f"{self.max_row_entries=} must be >= 1")
    if self.convert not in ("xla", "triton"):
      raise ValueError(f"{self.convert=} must be 'xla' or 'triton'")
    if self.weight_check not in ("auto", "xla", "gate"):
      raise ValueError(f"{self.weight_check=} must be 'auto', 'xla' or 'gate'")
    if self.hot_features < 0 or self.hot_features % common.TILE_N:
      raise ValueError(f"{self.hot_features=} must be a multiple of {common.TILE_N}, >= 0")


def supports(x, w_gate, w_up, w_down, *, interpret: bool = False, device=None) -> str | None:
  """None if the kernels can run this call on `device` (default: the default device), or in
  the interpreter; else a reason."""
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
  if not interpret and not target.on_hopper(device):
    return "needs a Hopper GPU (sm_90) as the device, or interpret=True"
  return None


def _check_operands(x, w_gate, w_up, w_down) -> tuple[int, int, int]:
  """(M, D, H) of the forward's operands; ValueError naming a misshapen or non-bf16 one."""
  if x.ndim != 2:
    raise ValueError(f"x must be [M, D], got shape {x.shape}")
  m, d = x.shape
  if w_up.ndim != 2 or w_up.shape[0] != d:
    raise ValueError(f"w_up must be [D={d}, H], got shape {w_up.shape}")
  h = w_up.shape[1]
  if w_gate is not None and w_gate.shape != (d, h):
    raise ValueError(f"w_gate must be [D={d}, H={h}], got shape {w_gate.shape}")
  if w_down.shape != (h, d):
    raise ValueError(f"w_down must be [H={h}, D={d}], got shape {w_down.shape}")
  for name, a in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if a is not None and a.dtype != jnp.bfloat16:
      raise ValueError(f"{name} must be bfloat16, got {a.dtype}")
  return m, d, h


def _cold_features(config: ForwardConfig, m: int, xp, wg_p, wup_p, wd_p, w_up_t, k_hot: int,
                   y_hot, interpret):
  """The features from `k_hot` on through the kernels (module docstring), on the padded
  operands: (y [Mp, Dp] with `y_hot` added, l1 per row [Mp], the rows that took the dense
  path [Mp], entries per row and tile [T, Mp], rows over the ELL width, tokens per feature
  from k_hot on [Hp - K], tokens per feature of the dense rows [Hp])."""
  mp, hp = xp.shape[0], wup_p.shape[1]
  gated, pad, slots = wg_p is not None, common.pad_to, config.gate.slots
  n_tiles = (hp - k_hot) // common.TILE_N
  # w_up (gated) and w_down: see the non-finite note below.
  checked = (wup_p if gated else None, wd_p)
  in_gate = config.weight_check == "gate" or (
      config.weight_check == "auto" and 0 < gate_pack_mgpu.check_blocks_per_tile(
          wd_p.size, mp, n_tiles, config.gate, interpret) <= GATE_CHECK_BLOCKS)
  packed = gate_pack_mgpu.gate_pack(
      xp, wg_p if gated else wup_p, col_start=k_hot, config=config.gate,
      check=checked if in_gate else (), interpret=interpret)
  if in_gate:
    words, counts, nonfinite = packed
  else:
    (words, counts), nonfinite = packed, reference.any_nonfinite(*checked)
  # The rows the sparse kernels cannot hold (a tile over S entries, or more than
  # max_row_entries), or every row when w_up (gated) or w_down holds a NaN / inf (the dense
  # FFN multiplies it by the zeros of h, spreading it to every row), run densely; the dense
  # kernels read their count on the device (no host round trip). They get n = 0 here;
  # padding rows have no entries.
  # The packed weight (w_gate, or w_up when non-gated) needs no check: its NaN / inf reach
  # the pre-activations, whose non-finite values are packed as active entries or are -inf,
  # which ReLU zeroes in the dense FFN as well.
  # (Checking w_up's transposed copy beside w_down in one reduction is no faster: the
  # transpose then slows down by what the reduction saves.)
  if config.convert == "triton":
    entries, n, pos, rows, tally = twell_to_ell_triton.twell_to_ell(
        words, counts, nonfinite, m=m, slots=slots, width=config.max_row_entries,
        config=config.convert_kernel, interpret=interpret)
    n_dense, n_over = tally, tally[1]    # the dense kernels read tally[0] themselves
    if entries.shape[1] % config.ell.group:
      entries = pad(entries, (mp, common.round_up(entries.shape[1], config.ell.group)))
    take = pos >= 0
  else:
    valid_row = jnp.arange(mp) < m
    entries, n, row_over, counts = ell_up_down_mgpu.ell_from_twell(
        words, counts, slots=slots, width=config.max_row_entries, group=config.ell.group)
    take = (row_over | nonfinite) & valid_row
    rank = jnp.cumsum(take, dtype=jnp.int32) - 1
    rows, n_dense = common.first_true(take, mp, fill=0), rank[-1] + 1
    pos, n = jnp.where(take, rank, -1), jnp.where(take, 0, n)
    n_over = jnp.sum((row_over & valid_row).astype(jnp.int32))
  dp = xp.shape[1]
  wup_t = (pad(w_up_t, (hp, dp)) if w_up_t is not None else wup_p.T) if gated else None
  y_d, l1_d, counts_dense = dense_rows_mgpu.dense_ffn_rows(
      xp, rows, n_dense, wg_p, wup_p, wd_p, config=config.dense_rows, interpret=interpret)
  y, _, l1_rows = ell_up_down_mgpu.ell_up_down(
      xp, entries, n, wup_t, wd_p, y_init=y_hot, dense=(pos, y_d, l1_d),
      write_u=False, config=config.ell, interpret=interpret)
  in_ell = jnp.arange(entries.shape[1])[None, :] < n[:, None]
  col = jnp.where(in_ell, lax.shift_right_logical(entries, 16) - k_hot, hp - k_hot)
  counts_cold = jnp.zeros((hp - k_hot,), jnp.int32).at[col.reshape(-1)].add(1, mode="drop")
  return y, l1_rows, take, counts, n_over, counts_cold, counts_dense


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def ffn_forward(x, w_gate, w_up, w_down, *, config: ForwardConfig = ForwardConfig(),
                w_up_t=None, interpret=False):
  """TwELL FFN forward. Returns (y [M, D] bf16, stats dict of device arrays).

  ``w_up_t`` optionally passes a pre-transposed [H, D] copy of ``w_up`` (layers can hold one
  to save the transpose). Stats: "l1" (mean over tokens of sum_j |h|), "nnz_per_token",
  "max_tile_nnz", "overflow_rows", "feature_counts" [H] int32 (tokens on which each feature
  fired).
  """
  m, d, h = _check_operands(x, w_gate, w_up, w_down)
  mp = common.round_up(m, gate_pack_mgpu.CTA_M)
  dp = common.round_up(d, 128)
  hp = common.round_up(h, common.TILE_N)
  k_hot = min(config.hot_features, hp)
  pad = common.pad_to
  xp, wup_p, wd_p = pad(x, (mp, dp)), pad(w_up, (dp, hp)), pad(w_down, (hp, dp))
  wg_p = pad(w_gate, (dp, hp)) if w_gate is not None else None
  valid_row = jnp.arange(mp) < m

  # The hot features: dense GEMMs on every row (rows that take the dense path below are
  # recomputed whole).
  y_hot = None
  hot_l1 = jnp.zeros((mp,), jnp.float32)
  hot_active = jnp.zeros((mp, 0), bool)
  if k_hot:
    y_hot, _, p_hot, h_hot = reference.dense_ffn_columns(xp, wg_p, wup_p, wd_p, k_hot)
    hot_l1 = jnp.sum(jnp.abs(h_hot.astype(jnp.float32)), axis=1)
    hot_active = p_hot > 0
  if k_hot == hp:
    # Every feature is hot: y_hot is the dense FFN itself (non-finite weights spread as there).
    y, l1_rows = y_hot, jnp.zeros((mp,), jnp.float32)
    take, cnt = jnp.zeros((mp,), bool), jnp.zeros((0, mp), jnp.int32)
    n_over = jnp.zeros((), jnp.int32)
    counts_cold, counts_dense = jnp.zeros((0,), jnp.int32), jnp.zeros((hp,), jnp.int32)
  else:
    y, l1_rows, take, cnt, n_over, counts_cold, counts_dense = _cold_features(
        config, m, xp, wg_p, wup_p, wd_p, w_up_t, k_hot, y_hot, interpret)
  live = ~take & valid_row
  # Dense rows' l1 covers the whole row; the sparse rows' adds the hot features'.
  l1_rows = jnp.where(live, l1_rows + hot_l1, jnp.where(take, l1_rows, 0.0))
  feature_counts = jnp.concatenate(
      [jnp.sum(hot_active & live[:, None], axis=0, dtype=jnp.int32), counts_cold]) + counts_dense

  cnt_valid = jnp.where(valid_row[None, :], cnt, 0)                    # [T, M]
  hot_valid = hot_active & valid_row[:, None]
  hot_tiles = jnp.sum(hot_valid.reshape(mp, k_hot // common.TILE_N, common.TILE_N), axis=2,
                      dtype=jnp.int32).T                                  # [K / 256, M]
  stats = {
      "heavy_rows_by_hot": common.heavy_rows_by_tile(
          jnp.concatenate([hot_tiles, cnt_valid]), config.max_row_entries, config.gate.slots)[
              :-(-h // common.TILE_N)],
      "l1": jnp.sum(l1_rows) / m,
      "nnz_per_token": (jnp.sum(cnt_valid) + jnp.sum(hot_valid)).astype(jnp.float32) / m,
      "max_tile_nnz": jnp.maximum(jnp.max(cnt_valid, initial=0), common.tile_max(hot_valid)),
      "overflow_rows": n_over,
      "feature_counts": feature_counts[:h],
  }
  return y[:m, :d], stats
