"""The exact ReLU FFN for few rows (decoding), reading only the weights of the features that
fire: for one row one kernel, for more two (Pallas, Triton backend); then a reduction.

For x [M, D] (M <= ``MAX_ROWS``, one row per sequence at a decode step):

    gated:      pre = x W_gate;  p = relu(pre);  h = p * (x W_up);   y = h W_down
    non-gated:  pre = x W_up;    p = relu(pre);  h = p;              y = h W_down

with the weights feature-major, [H, D] each: W_gate^T, W_up^T and W_down (row j: feature j's
weights, one contiguous D-long row; a block of features is one contiguous slab).

At a decode step the dense FFN streams all three weight matrices for a handful of rows: its
time is reading 3 H D weights. With a ReLU gate only the features with p > 0 in some row
contribute, and at paper-like activity (~30 of 5,632 per token, a few hundred at batch 16
as the rows share their hot features) that is a few percent of W_up and W_down:

  1. ``gate_up`` (grid: blocks of ``block_features`` hidden features). The gate product for
     its rows of W_gate^T over the whole of D (the one full read), rounded to x.dtype as the
     dense FFN's GEMM output is, then relu. ``fired`` = the features whose pre-activation is
     > 0 (or NaN, so that a NaN spreads as in the dense FFN) in some row. If any fired, the
     rows of W_up^T of the fired features only (a masked load: the others are not fetched),
     u = x W_up rounded to x.dtype, h = p * u in f32 rounded to x.dtype. Writes p and h
     [M, H] (zeros for features that fired nowhere).
  2. ``down`` (grid: groups of ``down_features`` features x column blocks of ``down_cols``).
     The features whose h is non-zero in some row, the W_down rows of those only (a masked
     load), partial[g] = h[:, group] W_down[group, cols] in f32.
  3. y = sum over the groups of partial, rounded to x.dtype (XLA; deterministic, no atomics).

For M <= ``rows_max`` (default 1: a single sequence) one kernel does all of it:

  ``rows`` (grid: blocks of ``rows_features`` features). A block's whole W_gate^T rows are
  loaded at once (D in one chunk up to ``rows_chunk``: every request of a program in flight
  together, no software pipeline, no MMA tile; the products are f32 multiply-and-sums in
  registers), then, if a feature fired, the fired rows of W_up^T and W_down (both requested
  before either is used), and the block's partial y [M, D] in f32 if a feature fired; a
  second kernel sums the partials of the blocks that hold one. At batch 1, paper shape,
  H100, weights read from memory (``benchmarks.probes.decode_gate``): 13.9 us per layer
  against the tiled kernels' 20.4 (``gate_up`` 13.8, of which the W_up pass after the gate
  loop is ~2.4 with the weights in L2; ``down`` 5.3) and the dense FFN's 28.4. With more
  rows the per-row products outgrow the registers (2 rows: 25-32 us against the tiled
  kernels' 20.7), so M > 1 takes the tiled kernels.

It is the dense ReLU FFN's function (``reference.dense_ffn_hidden``): the same roundings, sums in f32
in another order. A feature that fires in no row has its W_up^T row skipped, one whose h is
zero in every row its W_down row (they contribute nothing): a non-finite entry there (which
the dense FFN would spread as NaN) is not seen. A NaN or infinity in x or W_gate reaches y as
in the dense FFN.

Why Triton: the work is per-row masked loads (a feature's weights are fetched only if it
fired) and products with a handful of rows, below the 64-row tiles of Mosaic GPU's warpgroup
matrix multiply; Triton's dot runs 16 rows, and a masked-off lane issues no memory request.
(jax marks the Triton backend deprecated, as ``twell_to_ell_triton`` notes.)

Supported: M <= MAX_ROWS (the tiled kernels compute on Mp rows, a power of two >= 16,
Triton's smallest dot; rows past M are masked, read as zeros and not written);
any D and H (ragged blocks are masked); 16- or 32-bit floats. On a GPU the Triton backend;
``interpret=True`` runs it in the Pallas interpreter (CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _common as common
from pallas_kernels import _target as target

MAX_ROWS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """Tiles of the two kernels (powers of two >= 16), warps and pipeline stages.

  block_features: hidden features per ``gate_up`` program (its W_gate column block).
  block_d: the D chunk of one step of ``gate_up``'s loop over D.
  down_features, down_cols: the W_down tile of one ``down`` program.
  rows_max: calls of at most this many rows take the one-kernel ``rows`` path (0: never).
  rows_features, rows_chunk, rows_warps: its features per program, D chunk, warps.
  rows_sum: how its per-block partials are summed: "kernel" (blocks where nothing fired write
  nothing; a kernel of ``rows_sum_cols`` columns per program loads the partials of the blocks
  that fired only) or "xla" (those blocks write zeros and XLA sums every block's).
  Defaults tuned on an H100 at the paper's 0.5B shape (D 2048, H 5632; ``python -m
  benchmarks.sweeps.decode_ffn --sweep``): at 2 rows with 1% of H firing 16.3 us per call against
  the dense FFN's 29.3 (the 54 tilings measured span 16.1-26 us); at 16 rows and 10%, 19.9
  against 31.2. At 64 rows every union measured loses to dense (41-58 us against 38).
  The rows path's (``benchmarks.probes.decode_gate``: weights out of L2, one row, ~30
  features firing, 4 warps; us per layer, rows kernel + sum): 4 features 11.4 + 2.4 (the
  default), 8 features 12.3 + 2.1, 16 features 15.1 + 1.9; 8 features with 32 columns per
  sum program 12.3 + 2.5, with XLA's sum 12.9 + 2.5; 2 warps 19.1 in all; the dense FFN
  28.4. The gate product by XLA's GEMV instead (relu(x W_gate) written, the kernel reading
  it) measured slower: 6.4-8.6 us per layer for the GEMV alone, 16.3 in all.
  """
  block_features: int = 16
  block_d: int = 256
  down_features: int = 256
  down_cols: int = 128
  num_warps: int = 2
  num_stages: int = 3
  rows_max: int = 1
  rows_features: int = 4
  rows_chunk: int = 2048
  rows_warps: int = 4
  rows_sum: str = "kernel"
  rows_sum_cols: int = 8

  def __post_init__(self):
    for name in ("block_features", "block_d", "down_features", "down_cols", "rows_chunk"):
      v = getattr(self, name)
      if not (common.is_pow2(v) and v >= 16):
        raise ValueError(f"{name}={v} must be a power of two >= 16")
    if not (common.is_pow2(self.rows_features) and self.rows_features >= 2):
      raise ValueError(f"rows_features={self.rows_features} must be a power of two >= 2")
    target.check_triton_warps(self.num_warps)
    target.check_triton_warps(self.rows_warps)
    if self.num_stages < 1:
      raise ValueError(f"{self.num_stages=} must be >= 1")
    if self.rows_sum not in ("xla", "kernel"):
      raise ValueError(f"rows_sum={self.rows_sum!r} must be 'xla' or 'kernel'")
    if not common.is_pow2(self.rows_sum_cols):
      raise ValueError(f"rows_sum_cols={self.rows_sum_cols} must be a power of two")
    if not 0 <= self.rows_max <= MAX_ROWS:
      raise ValueError(f"rows_max={self.rows_max} must be in [0, {MAX_ROWS}]")


def padded_rows(m: int) -> int:
  """Mp: the rows the kernels run on for M rows (a power of two, at least 16)."""
  return common.pow2_at_least(m, 16)


def _gate_up_kernel(x_ref, wp_ref, wu_ref, p_ref, h_ref, *, m: int, mp: int, d: int, h: int,
                    bf: int, bd: int, gated: bool):
  dt = x_ref.dtype
  f0 = pl.program_id(0) * bf
  feat_ok = f0 + jnp.arange(bf, dtype=jnp.int32) < h
  row_ok = jnp.arange(mp, dtype=jnp.int32) < m
  steps = pl.cdiv(d, bd)
  out_mask = row_ok[:, None] & feat_ok[None, :]

  def x_chunk(i):
    k_ok = i * bd + jnp.arange(bd, dtype=jnp.int32) < d
    return k_ok, plt.load(x_ref.at[pl.ds(0, mp), pl.ds(i * bd, bd)],
                          mask=row_ok[:, None] & k_ok[None, :], other=0)

  def product(w_ref, rows):
    """x w_ref[f0:f0 + bf, :]^T [mp, bf] in f32, reading the rows where `rows`."""
    def step(i, acc):
      k_ok, xk = x_chunk(i)
      w = plt.load(w_ref.at[pl.ds(f0, bf), pl.ds(i * bd, bd)],
                   mask=rows[:, None] & k_ok[None, :], other=0)          # [bf, bd]
      return acc + lax.dot_general(xk, w, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    return lax.fori_loop(0, steps, step, jnp.zeros((mp, bf), jnp.float32))

  pre = product(wp_ref, feat_ok).astype(dt)
  p = jnp.maximum(pre, jnp.zeros_like(pre))
  plt.store(p_ref.at[pl.ds(0, mp), pl.ds(f0, bf)], p, mask=out_mask)
  if not gated:
    plt.store(h_ref.at[pl.ds(0, mp), pl.ds(f0, bf)], p, mask=out_mask)
    return
  # ~(pre <= 0): > 0, or NaN (relu keeps a NaN, and the dense FFN spreads it). Padding rows
  # read x as 0: pre 0.
  live = (jnp.max(jnp.where(pre <= 0, 0, 1), axis=0) > 0) & feat_ok
  n_live = jnp.sum(live.astype(jnp.int32))

  @pl.when(n_live == 0)
  def _none():
    plt.store(h_ref.at[pl.ds(0, mp), pl.ds(f0, bf)], jnp.zeros((mp, bf), dt), mask=out_mask)

  @pl.when(n_live > 0)
  def _up():
    u = product(wu_ref, live).astype(dt)
    hk = (p.astype(jnp.float32) * u.astype(jnp.float32)).astype(dt)
    plt.store(h_ref.at[pl.ds(0, mp), pl.ds(f0, bf)], hk, mask=out_mask)


def _down_kernel(h_ref, wd_ref, part_ref, *, m: int, mp: int, d: int, h: int, bf: int,
                 bc: int):
  f0 = pl.program_id(0) * bf
  c0 = pl.program_id(1) * bc
  feat_ok = f0 + jnp.arange(bf, dtype=jnp.int32) < h
  col_ok = c0 + jnp.arange(bc, dtype=jnp.int32) < d
  row_ok = jnp.arange(mp, dtype=jnp.int32) < m
  hk = plt.load(h_ref.at[pl.ds(0, mp), pl.ds(f0, bf)], mask=row_ok[:, None] & feat_ok[None, :],
                other=0)                                                    # [mp, bf]
  live = (jnp.max(jnp.where(hk != 0, 1, 0), axis=0) > 0) & feat_ok
  w = plt.load(wd_ref.at[pl.ds(f0, bf), pl.ds(c0, bc)],
               mask=live[:, None] & col_ok[None, :], other=0)               # [bf, bc]
  part = jnp.dot(hk, w, preferred_element_type=jnp.float32)
  plt.store(part_ref.at[pl.program_id(0), pl.ds(0, mp), pl.ds(c0, bc)], part,
            mask=row_ok[:, None] & col_ok[None, :])


def _rows_kernel(x_ref, wp_ref, wu_ref, wd_ref, p_ref, h_ref, part_ref, live_ref, *, m: int,
                 d: int, h: int, bf: int, cd: int, gated: bool, zero_dead: bool):
  """The whole FFN of ``bf`` features for m (few) rows: products as f32 multiply-and-sum over
  whole weight rows in registers (no MMA tile, no loop over D when D <= cd: a program's loads
  are in flight together), then the fired features' W_up and W_down rows; writes p, h, this
  block's y partial [m, D] (rows r * B + block of ``part_ref``, B the grid padded to a power
  of two) and whether it holds one
  (``live_ref``); ``zero_dead``: a block where nothing fired writes a zero partial, else
  none."""
  dt = x_ref.dtype
  pid = pl.program_id(0)
  blocks = live_ref.shape[0]            # the grid's, padded to a power of two
  f0 = pid * bf
  feat_ok = f0 + jnp.arange(bf, dtype=jnp.int32) < h
  chunks = pl.cdiv(d, cd)

  def part_at(r, i):
    return part_ref.at[pl.ds(r * blocks + pid, 1), pl.ds(i * cd, cd)]

  def tile(w_ref, rows, i):
    """w_ref[f0:f0 + bf, D chunk i] in f32, reading the weight rows `rows` only."""
    c_ok = i * cd + jnp.arange(cd, dtype=jnp.int32) < d
    return plt.load(w_ref.at[pl.ds(f0, bf), pl.ds(i * cd, cd)],
                    mask=rows[:, None] & c_ok[None, :], other=0).astype(jnp.float32)

  def row_sums(w, i, accs):
    """accs[r] + x_r[D chunk i] w^T for each row r ([bf] f32 each)."""
    k_ok = i * cd + jnp.arange(cd, dtype=jnp.int32) < d
    out = []
    for r in range(m):
      xr = plt.load(x_ref.at[pl.ds(r, 1), pl.ds(i * cd, cd)], mask=k_ok[None, :],
                    other=0).astype(jnp.float32)                            # [1, cd]
      out.append(accs[r] + jnp.sum(w * xr, axis=1))
    return tuple(out)

  def over_chunks(body, init):
    """body(i, carry) over the D chunks: one straight-line step when D is one chunk."""
    return body(0, init) if chunks == 1 else lax.fori_loop(0, chunks, body, init)

  def products(w_ref, rows):
    """[x_r w_ref[f0:f0 + bf, :]^T in f32 for each row r], reading the weight rows `rows`."""
    return over_chunks(lambda i, accs: row_sums(tile(w_ref, rows, i), i, accs),
                       tuple(jnp.zeros((bf,), jnp.float32) for _ in range(m)))

  pre = [v.astype(dt) for v in products(wp_ref, feat_ok)]
  p = [jnp.maximum(v, jnp.zeros_like(v)) for v in pre]
  for r in range(m):
    plt.store(p_ref.at[pl.ds(r, 1), pl.ds(f0, bf)], p[r][None], mask=feat_ok[None])
  # ~(pre <= 0): > 0, or NaN (as in `_gate_up_kernel`).
  fired = functools.reduce(jnp.logical_or, [~(v <= 0) for v in pre]) & feat_ok
  n_live = jnp.sum(fired.astype(jnp.int32))
  plt.store(live_ref.at[pl.ds(pid, 1)], jnp.full((1,), jnp.minimum(n_live, 1), jnp.int32))

  @pl.when(n_live == 0)
  def _none():
    for r in range(m):
      plt.store(h_ref.at[pl.ds(r, 1), pl.ds(f0, bf)], jnp.zeros((1, bf), dt),
                mask=feat_ok[None])

    if not zero_dead:
      return

    # A zero partial (for a sum that reads every block's: one XLA reduction, no select).
    def zeros(i, carry):
      c_ok = i * cd + jnp.arange(cd, dtype=jnp.int32) < d
      for r in range(m):
        plt.store(part_at(r, i), jnp.zeros((1, cd), jnp.float32), mask=c_ok[None])
      return carry
    over_chunks(zeros, 0)

  @pl.when(n_live > 0)
  def _fired():
    # With D in one chunk the fired rows of W_down are loaded with W_up's (both requests in
    # flight together), before the products that need W_up's.
    wd_early = tile(wd_ref, fired, 0) if chunks == 1 else None
    if gated:
      u = [v.astype(dt) for v in products(wu_ref, fired)]
      hk = [(p[r].astype(jnp.float32) * u[r].astype(jnp.float32)).astype(dt) for r in range(m)]
    else:
      hk = p
    for r in range(m):
      plt.store(h_ref.at[pl.ds(r, 1), pl.ds(f0, bf)], hk[r][None], mask=feat_ok[None])
    hf = [v.astype(jnp.float32)[:, None] for v in hk]                        # [bf, 1]

    def down(i, carry):
      c_ok = i * cd + jnp.arange(cd, dtype=jnp.int32) < d
      w = wd_early if wd_early is not None else tile(wd_ref, fired, i)
      for r in range(m):
        plt.store(part_at(r, i), jnp.sum(hf[r] * w, axis=0)[None], mask=c_ok[None])
      return carry
    over_chunks(down, 0)


def _sum_kernel(live_ref, part_ref, y_ref, *, m: int, blocks: int, d: int, dc: int):
  """y[:, cols] = the sum over the blocks that hold a partial (``live_ref``) of their partial
  rows, loaded together (the others' rows are masked off, never fetched); rounded to y's
  dtype."""
  c0 = pl.program_id(0) * dc
  col_ok = c0 + jnp.arange(dc, dtype=jnp.int32) < d
  bp = live_ref.shape[0]
  b = jnp.arange(bp, dtype=jnp.int32)
  live = plt.load(live_ref.at[pl.ds(0, bp)], mask=b < blocks, other=0) > 0
  for r in range(m):
    t = plt.load(part_ref.at[pl.ds(r * bp, bp), pl.ds(c0, dc)],
                 mask=live[:, None] & col_ok[None, :], other=0)               # [bp, dc]
    plt.store(y_ref.at[pl.ds(r, 1), pl.ds(c0, dc)], jnp.sum(t, axis=0)[None].astype(y_ref.dtype),
              mask=col_ok[None])


def _decode_rows(x, w_pre_t, w_up_t, w_down, *, config: DecodeConfig, interpret: bool):
  """`decode_ffn` for m <= config.rows_max rows: one kernel (`_rows_kernel`) and the sum of
  the blocks' partials (``config.rows_sum``: "kernel", the blocks that hold one, or "xla",
  every block's; deterministic either way)."""
  m, d = x.shape
  h = w_pre_t.shape[0]
  gated = w_up_t is not None
  bf = config.rows_features
  cd = min(config.rows_chunk, common.pow2_at_least(d, 16))
  blocks = pl.cdiv(h, bf)
  bp = common.pow2_at_least(blocks, 16)
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(x).mat)
  by_xla = config.rows_sum == "xla"
  p, hid, part, live = pl.pallas_call(
      functools.partial(_rows_kernel, m=m, d=d, h=h, bf=bf, cd=cd, gated=gated,
                        zero_dead=by_xla),
      out_shape=(out((m, h), x.dtype), out((m, h), x.dtype),
                 out((m * bp, d), jnp.float32), out((bp,), jnp.int32)),
      grid=(blocks,),
      in_specs=[anywhere] * 4,
      out_specs=[anywhere] * 4,
      compiler_params=plt.CompilerParams(num_warps=config.rows_warps, num_stages=1),
      interpret=interpret,
      name="twell_decode_rows",
  )(x, w_pre_t, w_up_t if gated else w_pre_t, w_down)
  if by_xla:
    return jnp.sum(part.reshape(m, bp, d)[:, :blocks], axis=1).astype(x.dtype), p, hid
  dc = config.rows_sum_cols
  y = pl.pallas_call(
      functools.partial(_sum_kernel, m=m, blocks=blocks, d=d, dc=dc),
      out_shape=out((m, d), x.dtype),
      grid=(pl.cdiv(d, dc),),
      in_specs=[anywhere] * 2,
      out_specs=anywhere,
      compiler_params=plt.CompilerParams(num_warps=config.rows_warps, num_stages=1),
      interpret=interpret,
      name="twell_decode_rows_sum",
  )(live, part)
  return y, p, hid


def supports(m: int, d: int, h: int, dtype) -> Optional[str]:
  """None when ``decode_ffn`` runs these shapes, else the reason."""
  if not 1 <= m <= MAX_ROWS:
    return f"{m} rows: the decode kernels run 1 to {MAX_ROWS} rows"
  if d < 1 or h < 1:
    return f"empty weights (D={d}, H={h})"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                              jnp.dtype(jnp.float32)):
    return f"dtype {jnp.dtype(dtype)}: bf16, f16 or f32 only"
  return None


def decode_ffn(x, w_pre_t, w_up_t, w_down, *, config: DecodeConfig = DecodeConfig(),
               interpret: bool = False):
  """(y [M, D] x.dtype, p [M, H] x.dtype, h [M, H] x.dtype) of the ReLU FFN (module
  docstring). The weights feature-major, [H, D] each: ``w_pre_t`` the relu'd product's
  weight transposed (W_gate^T, or W_up^T when non-gated); ``w_up_t`` W_up^T (gated), or None
  (non-gated); ``w_down``. p is relu(pre) and h the hidden activation (for statistics)."""
  m, d = x.shape
  h = w_pre_t.shape[0]
  gated = w_up_t is not None
  reason = supports(m, d, h, x.dtype)
  if reason is not None:
    raise ValueError(f"decode_ffn: {reason}")
  if (w_pre_t.shape != (h, d) or (gated and w_up_t.shape != (h, d))
      or w_down.shape != (h, d)):
    raise ValueError(f"decode_ffn: bad shapes x {x.shape}, w_pre_t {w_pre_t.shape}, w_up_t "
                     f"{None if w_up_t is None else w_up_t.shape}, w_down {w_down.shape}")
  if m <= config.rows_max:
    return _decode_rows(x, w_pre_t, w_up_t, w_down, config=config, interpret=interpret)
  mp = padded_rows(m)
  bf, bd = config.block_features, config.block_d
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  # Under shard_map the outputs vary over the manual axes as x does (the weights enter whole).
  out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(x).mat)
  params = plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  gate_up = pl.pallas_call(
      functools.partial(_gate_up_kernel, m=m, mp=mp, d=d, h=h, bf=bf, bd=bd, gated=gated),
      out_shape=(out((m, h), x.dtype),) * 2,
      grid=(pl.cdiv(h, bf),),
      in_specs=[anywhere] * 3,
      out_specs=[anywhere] * 2,
      compiler_params=params,
      interpret=interpret,
      name="twell_decode_gate_up",
  )
  # Non-gated: the kernel reads no W_up^T; w_pre_t fills the operand.
  p, hid = gate_up(x, w_pre_t, w_up_t if gated else w_pre_t)
  gf, bc = config.down_features, config.down_cols
  groups = pl.cdiv(h, gf)
  down = pl.pallas_call(
      functools.partial(_down_kernel, m=m, mp=mp, d=d, h=h, bf=gf, bc=bc),
      out_shape=out((groups, m, d), jnp.float32),
      grid=(groups, pl.cdiv(d, bc)),
      in_specs=[anywhere] * 2,
      out_specs=anywhere,
      compiler_params=params,
      interpret=interpret,
      name="twell_decode_down",
  )
  y = jnp.sum(down(hid, w_down), axis=0).astype(x.dtype)
  return y, p, hid
