"""Gate projection with TwELL packing in the epilogue (Mosaic GPU, Hopper).

    packed(relu(x @ w)):   x [M, K] bf16,  w [K, N] bf16  ->  words [M, N/256*S] int32,
                                                             counts [N/256, M] int32

The dense [M, N] activation never reaches HBM: every 128 x 256 output tile is computed with
wgmma (TMA, warp-specialized pipeline, f32 accumulators in registers) and packed in registers.

Internal TwELL layout (one record per row and 256-column tile t, S = 256 / compression slots):
  words[r, t*S + k] = (col << 16) | bf16_bits(relu(acc))   for the k-th positive of the tile
                      in increasing column order (k < min(count, S)), col its column in w
                      (read as an unsigned 16-bit field: N <= 65536);  0x7FFFFFFF after.
  counts[t, r]      = true number of positives of (r, t) (may exceed S:
                      the row is then an overflow row, which the caller must compute elsewhere;
                      the words of an overflowing record are all 0x7FFFFFFF).
ReLU is the strict test acc > 0 on the f32 accumulator; the value is rounded to bf16 (RN).

Packing (no atomics, no prefix sums; entries come out sorted and deterministic): with
key = (col << 16 | bits) for positives and 0x7FFFFFFF elsewhere, slot k of each row is the
row-minimum of the keys after removing the k smaller ones. The loop runs as many times as the
largest *non-overflowing* count among the warpgroup's 64 rows (~5 for ~30 actives of 5632), so
heavy rows cost nothing here.

Work split: CTA tile 128 x 256 x tile_k; 2 compute warpgroups of 64 rows each (one wgmma
m64n256 accumulator each, 128 f32 registers per thread); persistent grid over the SMs. The
compute warpgroups hand each finished tile to SMEM as bf16 and go on with the next tile; a
third, packing warpgroup packs it meanwhile, in 64-column chunks (``_kernel``; 0.499 ms on an
H100, where compute warpgroups packing their own tiles after the MMAs took 0.58: the tensor
cores idled meanwhile).
With ``check=`` the packing warpgroup also scans other arrays of one size (the forward's
w_up and w_down) for NaN / infinities, a few [64, 64] blocks before each of its tiles while
the tensor cores run, and a bool says whether it found one (``_ScanPlan``).
M must be a multiple of 128, N of 256, K of tile_k.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common as common
from pallas_kernels import _target as target


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateConfig:
  """Schedule of the gate kernel; every choice gives the same words. The defaults are the
  fastest measured on an H100 at the paper shape (0.499 ms against XLA's 0.477 ms for the
  plain GEMM without any packing)."""
  tile_k: int = 64
  # SMEM pipeline stages (the packing warpgroup's hand-over buffer takes a 4th stage's space:
  # with it, at most 3 stages of tile_k = 64 or 6 of 32 fit; 6 of 32 measured 0.63-0.65 ms
  # against 0.50-0.53 for 3 of 64). Never more than the K steps of one tile are used.
  max_concurrent_steps: int = 3
  grid_minor_dim: int = 0       # 0: M is the minor (fast) dimension of the tile walk, 1: N
  grid_tile_width: int = 8
  compression: int = 8
  # wgmma groups left in flight at the end of each K step (an SMEM stage is then released one
  # step later): 0 serializes MMA issue and completion, 1 overlaps them: 0.496 against 0.529
  # ms (H100, paper shape).
  delay_release: int = 1
  # Columns the packing warpgroup packs at a time (``_pack_chunks``): fewer live keys per
  # thread, fewer spills: 256 columns 0.551 ms (216 bytes of spills), 128 0.538 (120), 64
  # 0.533 (60). (Its extraction loop takes the row minimum over all keys per slot; a 2-way
  # queue merge halving the keys per step spilled: 0.59-0.64 ms.)
  pack_chunk: int = 64
  # How the packer takes the max count over its 64 rows (``_row_max``): "reduce" 0 spills,
  # 0.532 ms; "smem" 60 bytes, 0.533 ms.
  packer_row_max: str = "reduce"

  def __post_init__(self):
    if self.tile_k not in (32, 64):
      raise ValueError(f"{self.tile_k=} must be 32 or 64")
    if self.compression not in (2, 4, 8):
      raise ValueError(f"{self.compression=} must be 2, 4 or 8")
    if self.delay_release not in (0, 1):
      raise ValueError(f"{self.delay_release=} must be 0 or 1")
    if self.pack_chunk not in (64, 128, 256):
      raise ValueError(f"{self.pack_chunk=} must be 64, 128 or 256")
    if self.packer_row_max not in ("reduce", "smem"):
      raise ValueError(f"{self.packer_row_max=} must be 'reduce' or 'smem'")
    if self.max_concurrent_steps < 1:
      raise ValueError(f"{self.max_concurrent_steps=} must be >= 1")
    if self.smem_bytes() > _SMEM_BYTES:
      raise ValueError(f"{self.max_concurrent_steps} SMEM stages of tile_k={self.tile_k} and "
                       f"the hand-over buffer need {self.smem_bytes()} bytes of SMEM, more "
                       f"than {_SMEM_BYTES}; got {self}")

  def smem_bytes(self) -> int:
    """SMEM of ``_kernel``: the (x, w) stages, the bf16 hand-over buffer of both
    compute warpgroups and the words / counts staging buffers."""
    stage = (CTA_M + TILE_N) * self.tile_k * 2
    return (self.max_concurrent_steps * stage + 2 * WG_M * TILE_N * 2
            + WG_M * (self.slots + 2) * 4)

  @property
  def slots(self) -> int:
    return common.TILE_N // self.compression


WG_M = 64          # rows per compute warpgroup
CTA_M = 2 * WG_M   # rows per CTA tile
TILE_N = common.TILE_N
# Dynamic SMEM one CTA may use on Hopper (227 KiB).
_SMEM_BYTES = 227 * 1024


# A non-positive gate entry is written as bf16 -0.0 (bits 0x8000, negative as int16), while
# every positive entry's bf16 bits (+0.0 for an f32 value that underflows bf16, up to +inf)
# are >= 0 as int16: positivity survives the rounding to bf16, and one bitcast gives both the
# test and the value bits. (Taking the bits from bf16(acc) widened back to f32 would let XLA
# drop the rounding where excess precision is allowed, e.g. interpret mode on a GPU host.)
_NOT_POSITIVE = -0.0
_POSITIVE_NAN = float("nan")   # bf16 0x7FC0: sign bit clear, so it counts as positive


def _handover_tile(acc):
  """[64, 256] f32 -> bf16 (round to nearest) with every entry not > 0 replaced by -0.0, except
  NaN, which stays a (positive) NaN: relu(NaN) is NaN in the dense FFN, so a NaN gate is an
  active entry whose NaN reaches the output as it does there."""
  return jnp.where(acc > 0, acc.astype(jnp.bfloat16),
                   jnp.where(acc != acc, jnp.bfloat16(_POSITIVE_NAN),
                             jnp.bfloat16(_NOT_POSITIVE)))


def _bits(vals):
  """bf16 hand-over values -> int32 bit patterns, negative where not positive."""
  return lax.bitcast_convert_type(vals, jnp.int16).astype(jnp.int32)   # sign-extends


def _row_max(row_vec, cnt_smem):
  """max over the 64 rows of a row-layout int32 vector. With ``cnt_smem`` (the warpgroup's
  own [64] SMEM scratch): a store and 64 scalar loads, for kernels where two warpgroups pack
  at once (a cross-warp array reduction uses one shared reduction scratch, which they would
  race on). Without: that reduction (warp shuffles, then across the 4 warps through SMEM)."""
  if cnt_smem is None:
    return jnp.max(row_vec)
  cnt_smem[...] = row_vec
  out = cnt_smem[0]
  for i in range(1, WG_M):
    out = jnp.maximum(out, cnt_smem[i])
  return out


def _pack_chunks(load, n_chunks: int, cfg: GateConfig, cnt_smem, after_loads=None):
  """Packs one 64-row record block from its ``_handover_tile`` values, read in column chunks:
  ``load(c)`` gives chunk c ([64, 256 / n_chunks] bf16, WGMMA layout; called twice per chunk
  when n_chunks > 1, once to count and once to pack, so that only one chunk's keys are live).
  ``after_loads()`` runs after the last load (the packing warpgroup releases its hand-over
  buffer there). ``cnt_smem``: the warpgroup's own [64] int32 scratch for ``_row_max``, or
  None for the warp reduction (only where a single warpgroup packs at a time).

  Every key of a chunk is smaller than every key of the next one (the column is the key's
  high half), so the record is each chunk's sorted positives, one after the other: chunk c's
  k-th positive goes to slot (positives of the chunks before c) + k.

  Each chunk's loop runs as many times as its largest count among the rows whose record
  fits (count <= S); records that overflow (count > S) are written as EMPTY words.
  """
  slots, width = cfg.slots, TILE_N // n_chunks
  first = load(0)
  cnts = [jnp.sum((_bits(first if c == 0 else load(c)) >= 0).astype(jnp.int32), axis=1)
          for c in range(n_chunks)]                                     # [64], row layout
  total = functools.reduce(jnp.add, cnts)
  slot_iota = plgpu.layout_cast(
      lax.broadcasted_iota(jnp.int32, (WG_M, slots), 1), plgpu.Layout.WGMMA)
  words = slot_iota * 0 + common.EMPTY_WORD
  fits = total <= slots
  base = total * 0                         # positives of the chunks already packed, per row

  def put(words, slot, kmin):
    # The carry is the 'true' case of each select so that its signedness is kept.
    return jnp.where(slot_iota != lax.broadcast_in_dim(slot, (WG_M, slots), (0,)), words,
                     lax.broadcast_in_dim(kmin, (WG_M, slots), (0,)))

  for c, cnt in enumerate(cnts):
    b = _bits(first if c == 0 else load(c))
    if c == n_chunks - 1 and after_loads is not None:
      after_loads()
    col = plgpu.layout_cast(
        lax.broadcasted_iota(jnp.int32, (WG_M, width), 1), plgpu.Layout.WGMMA) + c * width
    # (EMPTY as the 'true' case: Mosaic's select takes the signedness of the true case.)
    key = jnp.where(b < 0, common.EMPTY_WORD, col * 65536 + b)
    n_iter = _row_max(jnp.where(fits, cnt, 0), cnt_smem)

    def body(k, carry, base=base):
      key, words = carry
      kmin = jnp.min(key, axis=1)                                    # [64]
      key = jnp.where(key != lax.broadcast_in_dim(kmin, (WG_M, width), (0,)),
                      key, common.EMPTY_WORD)
      return key, put(words, base + k, kmin)

    _, words = lax.fori_loop(0, n_iter, body, (key, words))
    base = base + cnt
  # Overflowing records: EMPTY (their row is computed elsewhere; a partial record would
  # depend on the loop bounds of the other rows).
  words = jnp.where(lax.broadcast_in_dim(fits, (WG_M, slots), (0,)), words, common.EMPTY_WORD)
  return words, total


# The arrays the packing warpgroup checks for NaN / infinities are viewed as [rows, SCAN_COLS]
# and read in [64, SCAN_COLS] blocks in the WGMMA layout (whose reductions the packer already
# runs: a row-wise one, then one over the 64 rows). 64 columns: one block of each of two
# arrays is 32 registers per thread, well within what the packer has beside the MMAs'
# warpgroups.
SCAN_COLS = 64
SCAN_BLOCK = WG_M * SCAN_COLS


@dataclasses.dataclass(frozen=True)
class _ScanPlan:
  """How the CTAs share the ``blocks`` [64, SCAN_COLS] blocks of each of the ``arrays``
  arrays they check.

  CTA ``sm`` checks blocks sm + num_sms * j, j < per_cta (clamped to the last block), of
  each: ``per_tile`` of them before each of its first ``slots`` tiles (every CTA has at least
  ``slots`` tiles), writing one flag per tile; or, where some CTA has no tile at all
  (``per_tile`` 0), all of them after its tiles, into one flag.
  """
  arrays: int
  blocks: int
  per_cta: int
  per_tile: int
  slots: int

  @classmethod
  def make(cls, arrays: int, blocks: int, num_sms: int, tiles: int) -> "_ScanPlan":
    per_cta = -(-blocks // num_sms)
    min_tiles = tiles // num_sms
    if min_tiles == 0:
      return cls(arrays, blocks, per_cta, 0, 1)
    per_tile = -(-per_cta // min_tiles)
    return cls(arrays, blocks, per_cta, per_tile, -(-per_cta // per_tile))


def _scan_nonfinite(refs, plan: _ScanPlan, sm, j0, count: int):
  """1 (int32) if blocks j0 .. j0 + count - 1 of CTA ``sm``'s share (``_ScanPlan``) of any of
  ``refs`` (bf16 [blocks * 64, SCAN_COLS]) hold a NaN or an infinity (all exponent bits set),
  else 0. Each step loads one block of every array before testing any, so that their loads
  are in flight together."""
  num_sms = lax.axis_size("sm")

  def step(j, found):
    b = jnp.minimum(sm + num_sms * jnp.minimum(j, plan.per_cta - 1), plan.blocks - 1)
    blocks = [plgpu.load(ref.at[pl.ds(b * WG_M, WG_M)], layout=plgpu.Layout.WGMMA,
                         optimized=False)
              for ref in refs]
    for v in blocks:
      bits = lax.bitcast_convert_type(v, jnp.int16).astype(jnp.int32)
      bad = jnp.max(((bits & 0x7F80) == 0x7F80).astype(jnp.int32), axis=1)   # [64]
      found = bad if found is None else jnp.maximum(found, bad)
    return found

  found = step(j0, None)
  if count > 1:
    found = lax.fori_loop(j0 + 1, j0 + count, step, found)
  return jnp.max(found)


def _smem_transforms(cfg: GateConfig):
  """SMEM tiling / swizzle of the (x, w) stages and of the words staging buffer."""
  swizzle = plgpu.find_swizzle(cfg.tile_k * 16)
  words_sw = plgpu.find_swizzle(cfg.slots * 32)
  return ((plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)),
          (plgpu.TilingTransform((8, words_sw // 4)), plgpu.SwizzleTransform(words_sw)))


def _store_packed(words, counts, words_smem, counts_smem, words_gmem, counts_gmem, rows,
                  n_idx, col_base):
  """Stages one 64-row record block in SMEM and TMA-stores it at (rows, tile n_idx): words
  [64, S] (columns local to the tile) into words[rows, tile slots] with ``col_base``, the
  tile's first column in w, added to their columns, the row counts [64] into
  counts[n_idx, rows]."""
  slots = words.shape[1]
  # Columns of w in the words: the ELL rows built from them need no tile arithmetic. (Past
  # column 32767 the word is negative as an int32; nothing compares packed words any more.)
  words = words + jnp.where(words == common.EMPTY_WORD, 0, col_base * 65536)
  # The previous TMA stores must be done reading the staging buffers.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  words_smem[...] = words
  counts_smem[...] = counts
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(words_smem, words_gmem.at[rows, pl.ds(n_idx * slots, slots)],
                          commit_group=False)
  plgpu.copy_smem_to_gmem(counts_smem, counts_gmem.at[n_idx, rows], commit_group=False)
  plgpu.commit_smem_to_gmem_group()


def _kernel(x_gmem, w_gmem, *refs, cfg: GateConfig, tile_start: int | None,
            scan: _ScanPlan | None):
  """Gate GEMM with a packing warpgroup (3 warpgroups, hand-written pipeline).

  Warpgroups 0 and 1 compute (64 rows each of the 128 x 256 tile, wgmma into registers);
  warpgroup 0 also issues the TMA loads, ``stages`` K steps ahead (a fourth, producer-only
  warpgroup would cut every warpgroup's registers to 128: 512 threads share the 64K register
  file, and ptxas then cannot fit a 64 x 256 f32 accumulator). Per tile, each compute
  warpgroup writes its finished accumulator as bf16 (``_handover_tile``) into ``vals_smem``
  and goes on with the next tile's MMAs; warpgroup 2 reads both halves, packs them and
  TMA-stores words / counts. Barriers: ``produced`` / ``consumed`` per SMEM stage (2 TMA
  arrivals / 2 compute arrivals), ``vals_full`` (2 compute arrivals), ``vals_free`` (the
  packer; it pre-arrives once so that the first tile does not wait). Every barrier phase is
  waited for before the kernel ends (the interpreter checks it; harmless on the device).

  With ``scan``, ``refs`` starts with the arrays to check for NaN / infinities ([R,
  SCAN_COLS] views) and ends with their flags; the packer checks its share of their blocks
  (``_ScanPlan``) before it waits for each tile, while the tensor cores run.
  ``tile_start`` None: the first input ref (after x and w) holds the first tile at run time,
  and the tiles are stored at their place in w (``gate_pack``'s run-time ``col_start``).
  """
  if tile_start is None:
    start_gmem, refs = refs[0], refs[1:]
    tile_start = out_tile0 = start_gmem[0]
  else:
    out_tile0 = 0
  n_scan = scan.arrays if scan is not None else 0
  scan_refs, (words_gmem, counts_gmem), flags = (
      refs[:n_scan], refs[n_scan:n_scan + 2], refs[n_scan + 2:])
  m, k = x_gmem.shape
  _, n = w_gmem.shape
  slots, tile_k = cfg.slots, cfg.tile_k
  m_iters, n_iters, k_iters = m // CTA_M, n // TILE_N - tile_start, k // tile_k
  # A refill lands at most one tile ahead (see _release), so never more stages than K steps.
  stages = min(cfg.max_concurrent_steps, k_iters)
  lag = cfg.delay_release
  transforms, words_tr = _smem_transforms(cfg)
  vals_tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  packer_wg = 2
  sm, num_sms = lax.axis_index("sm"), lax.axis_size("sm")
  # nd_loop gives this CTA the tiles sm, sm + num_sms, ...; "steps" count its K steps over
  # all of them (global step g = local tile * k_iters + kk).
  local_tiles = lax.div(m_iters * n_iters - sm + num_sms - 1, num_sms)
  total_steps = local_tiles * k_iters

  def tile_coords(lin):
    return plgpu.planar_snake(lin, (m_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)

  @functools.partial(
      pl.run_scoped,
      x_smem=plgpu.SMEM((stages, CTA_M, tile_k), x_gmem.dtype, transforms=transforms),
      w_smem=plgpu.SMEM((stages, tile_k, TILE_N), w_gmem.dtype, transforms=transforms),
      vals_smem=plgpu.SMEM((2, WG_M, TILE_N), jnp.bfloat16, transforms=vals_tr),
      words_smem=plgpu.SMEM((WG_M, slots), jnp.int32, transforms=words_tr),
      counts_smem=plgpu.SMEM((WG_M,), jnp.int32),
      cnt_smem=plgpu.SMEM((WG_M,), jnp.int32),
      produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      vals_full=plgpu.Barrier(num_arrivals=2),
      vals_free=plgpu.Barrier(num_arrivals=1),
      collective_axes="wg",
  )
  def _scope(x_smem, w_smem, vals_smem, words_smem, counts_smem, cnt_smem, produced,
             consumed, vals_full, vals_free):
    wg = lax.axis_index("wg")

    def issue_load(g, coords=None):
      # (coords: the tile of step g when the caller has them, to keep the planar_snake
      # arithmetic out of the MMA loop, where the accumulator holds 128 registers.)
      m_idx, n_idx = coords or tile_coords(sm + lax.div(g, k_iters) * num_sms)
      kk, slot = lax.rem(g, k_iters), lax.rem(g, stages)
      plgpu.copy_gmem_to_smem(
          x_gmem.at[pl.ds(m_idx * CTA_M, CTA_M), pl.ds(kk * tile_k, tile_k)],
          x_smem.at[slot], produced.at[slot])
      plgpu.copy_gmem_to_smem(
          w_gmem.at[pl.ds(kk * tile_k, tile_k), pl.ds((n_idx + tile_start) * TILE_N, TILE_N)],
          w_smem.at[slot], produced.at[slot])

    @pl.when(wg < packer_wg)
    def _compute():
      @pl.when(wg == 0)
      def _prologue():
        @pl.loop(0, jnp.minimum(stages, total_steps))
        def _(g):
          issue_load(g)

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
      def _tile(info):
        (lin,) = info.index
        base = info.local_index * k_iters
        # Refills run `stages` steps ahead: into this tile or the next one.
        this_tile, next_tile = tile_coords(lin), tile_coords(lin + num_sms)

        def _release(kk):
          # Step kk's MMAs are done: free its stage and (warpgroup 0, once both are done with
          # it) load step kk + stages into it, which stages <= k_iters puts in this tile or
          # the next.
          g = base + kk
          slot = lax.rem(g, stages)
          plgpu.barrier_arrive(consumed.at[slot])

          @pl.when(jnp.logical_and(wg == 0, g + stages < total_steps))
          def _refill():
            plgpu.barrier_wait(consumed.at[slot])
            same = kk + stages < k_iters
            coords = tuple(jnp.where(same, a, b) for a, b in zip(this_tile, next_tile))
            issue_load(g + stages, coords)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((WG_M, TILE_N), jnp.float32))
        def _acc_scope(acc_ref):
          @pl.loop(0, k_iters)
          def _step(kk):
            slot = lax.rem(base + kk, stages)
            plgpu.barrier_wait(produced.at[slot])
            plgpu.wgmma(acc_ref, x_smem.at[slot, pl.ds(wg * WG_M, WG_M)], w_smem.at[slot])
            # With lag 1 the MMAs of step kk stay in flight while step kk - 1's stage is freed.
            plgpu.wgmma_wait(lag)
            if lag:
              @pl.when(kk > 0)
              def _():
                _release(kk - 1)
            else:
              _release(kk)

          if lag:
            plgpu.wgmma_wait(0)
            _release(k_iters - 1)
          vals = _handover_tile(acc_ref[...])
          plgpu.barrier_wait(vals_free)
          vals_smem[wg] = vals
          plgpu.barrier_arrive(vals_full)

      @pl.when(wg == 0)
      def _drain():
        @pl.loop(jnp.maximum(total_steps - stages, 0), total_steps)
        def _(g):
          plgpu.barrier_wait(consumed.at[lax.rem(g, stages)])

      plgpu.barrier_wait(vals_free)      # the packer's release of the last tile

    @pl.when(wg == packer_wg)
    def _packer():
      plgpu.barrier_arrive(vals_free)

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
      def _tile(info):
        (lin,) = info.index
        m_idx, n_idx = tile_coords(lin)
        if scan is not None and scan.per_tile:
          @pl.when(info.local_index < scan.slots)
          def _check():
            flags[0][sm, info.local_index] = _scan_nonfinite(
                scan_refs, scan, sm, info.local_index * scan.per_tile, scan.per_tile)
        plgpu.barrier_wait(vals_full)
        for half in range(2):
          load = lambda c, half=half: plgpu.load(
              vals_smem.at[half, :, pl.ds(c * cfg.pack_chunk, cfg.pack_chunk)],
              layout=plgpu.Layout.WGMMA)
          # After the last load of the second half, the compute warpgroups may overwrite the
          # hand-over buffer while it is packed (the arrive orders the loads before it).
          release = (lambda: plgpu.barrier_arrive(vals_free)) if half == 1 else None
          words, counts = _pack_chunks(load, TILE_N // cfg.pack_chunk, cfg,
                                       cnt_smem if cfg.packer_row_max == "smem" else None,
                                       release)
          rows = pl.ds(m_idx * CTA_M + half * WG_M, WG_M)
          _store_packed(words, counts, words_smem, counts_smem, words_gmem, counts_gmem,
                        rows, n_idx + out_tile0, (n_idx + tile_start) * TILE_N)

      if scan is not None and not scan.per_tile:
        # Fewer tiles than CTAs for some: each checks all its blocks once its tiles are done.
        flags[0][sm, 0] = _scan_nonfinite(scan_refs, scan, sm, 0, scan.per_cta)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gate_pack(x, w, *, col_start: int | jax.Array = 0, config: GateConfig = GateConfig(),
              check=(), interpret=False):
  """TwELL-packed relu(x @ w[:, col_start:]). Returns (words [M, T*S] int32,
  counts [T, M] int32); the words hold columns of w (from col_start on). ``col_start`` (a
  multiple of 256) leaves the leading columns out: the callers compute those (the hottest
  features) as dense GEMMs.

  ``col_start`` a Python int: T = (N - col_start) / 256 tiles, from col_start on. An int32
  scalar array: its value is read at run time, T = N / 256 and tile t is w's tile t; the
  counts of the tiles before col_start are 0 and their words undefined. One compiled kernel
  then serves every col_start (a training step whose layers differ only in their number of
  hot features compiles it once).

  ``check``: bf16 arrays of one size, a multiple of ``SCAN_BLOCK`` elements (None entries
  skipped), which the packing warpgroup checks for NaN / infinities while the tensor cores
  run: then a third output, a bool scalar, True when one of
  them holds such a value (``reference.any_nonfinite`` without a pass of its own). Only with
  a Python int ``col_start``."""
  m, k = x.shape
  k2, n = w.shape
  if k != k2:
    raise ValueError(f"x {x.shape} and w {w.shape} do not contract")
  if m % CTA_M or n % TILE_N or k % config.tile_k:
    raise ValueError(f"gate_pack needs M % {CTA_M} == 0, N % {TILE_N} == 0, "
                     f"K % {config.tile_k} == 0; got {x.shape=} {w.shape=}")
  check = tuple(a for a in check if a is not None)
  if isinstance(col_start, (int, np.integer)):
    if col_start % TILE_N or not 0 <= col_start < n:
      raise ValueError(f"gate_pack needs col_start a multiple of {TILE_N} in [0, N={n}); "
                       f"got {col_start}")
    return _gate_pack(x, w, check, col_start=int(col_start), config=config,
                      interpret=interpret)
  if check:
    raise ValueError("gate_pack(check=) needs a Python int col_start")
  if jnp.shape(col_start) not in ((), (1,)):
    raise ValueError(f"gate_pack's run-time col_start is one int32; got shape "
                     f"{jnp.shape(col_start)}")
  if not isinstance(col_start, jax.core.Tracer):   # a value known here is checked here
    value = int(np.asarray(col_start).reshape(()))
    if value % TILE_N or not 0 <= value < n:
      raise ValueError(f"gate_pack needs col_start a multiple of {TILE_N} in [0, N={n}); "
                       f"got {value}")
  start = jnp.asarray(col_start, jnp.int32).reshape(1) // TILE_N
  words, counts = _gate_pack(x, w, (), start, col_start=None, config=config,
                             interpret=interpret)
  # The kernel does not write the tiles before col_start.
  counts = jnp.where(jnp.arange(n // TILE_N)[:, None] < start, 0, counts)
  return words, counts


@common.jit_kernel_entry(("col_start", "config", "interpret"))
def _gate_pack(x, w, check, start=None, *, col_start, config, interpret):
  """The kernel call of ``gate_pack`` (``col_start`` None: the first tile is ``start`` [1]
  int32, read at run time)."""
  m, _ = x.shape
  n = w.shape[1]
  t = n // TILE_N if col_start is None else (n - col_start) // TILE_N
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
  with target.interpret_context(bool(interpret)):
    grid = _grid(config)
    out_type = (jax.ShapeDtypeStruct((m, t * config.slots), jnp.int32),
                jax.ShapeDtypeStruct((t, m), jnp.int32))
    plan = _scan_plan(check, grid, _tiles(m, t))
    kernel = functools.partial(
        _kernel, cfg=config, tile_start=None if col_start is None else col_start // TILE_N,
        scan=plan)
    if plan is not None:
      out_type += (jax.ShapeDtypeStruct((grid, plan.slots), jnp.int32),)
    f = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(grid,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=params,
        interpret=target.interpret_params(interpret),
        kernel_name="twell_gate_pack",
    )
    args = (x, w, *([start] if col_start is None else []),
            *[a.reshape(-1, SCAN_COLS) for a in check])
    outs = common.call_kernel(f, *args)
  if not check:
    return outs
  words, counts, flags = outs
  return words, counts, jnp.any(flags != 0)


def check_blocks_per_tile(size: int, m: int, n_tiles: int, config: GateConfig = GateConfig(),
                          interpret=False) -> int:
  """The [64, SCAN_COLS] blocks of each checked array of ``size`` elements that a CTA of
  ``gate_pack(check=)`` reads before each of its tiles (x [m, K], ``n_tiles`` 256-column
  tiles): 0 when some CTA has no tile, which then reads its whole share after its tiles, one
  block after another."""
  with target.interpret_context(bool(interpret)):
    grid = _grid(config)
  return _ScanPlan.make(1, -(-size // SCAN_BLOCK), grid, _tiles(m, n_tiles)).per_tile


def _grid(config: GateConfig) -> int:  # pylint: disable=unused-argument
  """The persistent kernel's CTAs: one per SM."""
  return target.num_sms()


def _tiles(m: int, n_tiles: int) -> int:
  """The [CTA_M, 256] output tiles the CTAs share."""
  return (m // CTA_M) * n_tiles


def _scan_plan(check, num_sms: int, tiles: int) -> _ScanPlan | None:
  """The blocks each CTA checks (``_ScanPlan``), None without arrays; refuses arrays the
  scan cannot read."""
  if not check:
    return None
  size = check[0].size
  for a in check:
    if a.dtype != jnp.bfloat16 or a.size != size or size % SCAN_BLOCK:
      raise ValueError(f"gate_pack checks bf16 arrays of one size, a multiple of {SCAN_BLOCK} "
                       f"elements; got {[(c.shape, str(c.dtype)) for c in check]}")
  return _ScanPlan.make(len(check), size // SCAN_BLOCK, num_sms, tiles)


def unpack_to_dense(words, counts, n: int, compression: int = 8, dtype=jnp.bfloat16):
  """Pure-JAX decoder of the internal layout (for tests): dense [M, n] relu values (n: w's N;
  the columns before gate_pack's col_start stay zero).

  Entries of overflowing tiles (count > S) are not representable and decode to zeros.
  """
  m = words.shape[0]
  s = common.TILE_N // compression
  w = words.reshape(m, words.shape[1] // s, s)
  cnt = counts.T
  valid = (jnp.arange(s)[None, None, :] < cnt[..., None]) & (cnt[..., None] <= s)
  col = lax.shift_right_logical(w, 16)
  val = lax.bitcast_convert_type((w & 0xFFFF).astype(jnp.uint16), jnp.bfloat16)
  val = jnp.where(valid, val, 0).astype(dtype)
  col = jnp.where(valid, col, n)  # out of range -> dropped
  out = jnp.zeros((m, n), dtype)
  rows = jnp.broadcast_to(jnp.arange(m)[:, None, None], col.shape)
  return out.at[rows, col].set(val, mode="drop")


def pack_reference(g, compression: int = 8):
  """Pure-JAX packer of relu(g) (g [M, N] f32) into the internal layout (tests, diagnostics)."""
  m, n = g.shape
  s = common.TILE_N // compression
  t = n // common.TILE_N
  g = g.reshape(m, t, common.TILE_N)
  pos = g > 0
  bits = lax.bitcast_convert_type(g.astype(jnp.bfloat16), jnp.uint16).astype(jnp.int32)
  key = jnp.where(pos, (jnp.arange(common.TILE_N) << 16)[None, None, :] | bits,
                  common.EMPTY_WORD)
  cnt = jnp.sum(pos, axis=-1).astype(jnp.int32)
  words = jnp.where((cnt <= s)[..., None], jnp.sort(key, axis=-1)[..., :s], common.EMPTY_WORD)
  tile_base = (jnp.arange(t, dtype=jnp.int32) * common.TILE_N * 65536)[None, :, None]
  words = jnp.where(words == common.EMPTY_WORD, words, words + tile_base).reshape(m, t * s)
  return words, cnt.T
