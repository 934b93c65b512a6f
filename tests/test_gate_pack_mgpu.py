"""Gate GEMM with the TwELL packing epilogue (pallas_kernels/gate_pack_mgpu.py).

Words and counts against the dense gate (decoded), every schedule against the default bit for
bit, the race detector over the packing warpgroup's hand-written pipeline, and lowering for
CUDA. Interpret-mode twins run on the CPU; the GPU class needs a Hopper GPU.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_test_util as ktu
from pallas_kernels import gate_pack_mgpu


class GatePackTestBase(ktu.KernelTestBase):

  @parameterized.named_parameters(
      dict(testcase_name="uniform", skew={}),
      # A feature that fires on 70% of the rows and 90% dead features: hot tiles overflow.
      dict(testcase_name="skewed", skew=dict(dead_fraction=0.9, hottest=0.7, row_spread=0.5)),
  )
  def test_matches_dense_gate(self, skew):
    x, wg, _, _ = ktu.inputs(256, 128, 512, active=12, heavy=0.02, seed=1, **skew)
    self._check_against_dense(x, wg, *gate_pack_mgpu.gate_pack(x, wg, interpret=self.INTERPRET))

  def test_run_time_col_start_matches_the_static_one(self):
    """col_start as an int32 array (one kernel for every start): the tiles from col_start on
    hold the static call's words and counts, the counts before it are 0."""
    x, wg, _, _ = ktu.inputs(256, 128, 768, active=12, heavy=0.02, seed=3)
    want_words, want_counts = gate_pack_mgpu.gate_pack(x, wg, col_start=256,
                                                       interpret=self.INTERPRET)
    words, counts = gate_pack_mgpu.gate_pack(x, wg, col_start=jnp.int32(256),
                                             interpret=self.INTERPRET)
    self.assertEqual(words.shape, (256, 3 * 32))
    np.testing.assert_array_equal(np.asarray(counts[0]), 0)
    np.testing.assert_array_equal(np.asarray(counts[1:]), np.asarray(want_counts))
    np.testing.assert_array_equal(np.asarray(words[:, 32:]), np.asarray(want_words))

  def _check_against_dense(self, x, wg, words, counts):
    """Counts exact, every record that fits decodes to relu(x @ wg) (bf16 values, the exact
    column set); at least 100 rows fit everywhere."""
    m, n = x.shape[0], wg.shape[1]
    g = np.asarray(jnp.dot(x, wg, preferred_element_type=jnp.float32))
    cnt = (g > 0).reshape(m, n // 256, 256).sum(-1)
    np.testing.assert_array_equal(np.asarray(counts), cnt.T)
    dense = np.asarray(gate_pack_mgpu.unpack_to_dense(words, counts, n), np.float32)
    ok = (cnt <= 32).all(1)
    self.assertGreater(ok.sum(), 100)
    ref = np.maximum(g, 0)[ok]
    np.testing.assert_allclose(dense[ok], ref, rtol=1e-2, atol=1e-3)
    # Sorted, exact column sets: the decoded support equals the positive set.
    np.testing.assert_array_equal(dense[ok] > 0, ref > 0)

  @parameterized.parameters(
      dict(max_concurrent_steps=2, grid_minor_dim=1),
      dict(delay_release=0),
      dict(pack_chunk=128, packer_row_max="smem"))
  def test_configs_agree(self, **kw):
    """Pipelining depth, the tile walk's order, MMAs left in flight and the packing
    warpgroup's chunk width / row-max method change the schedule, never the result. (tile_k changes the interpreter's f32 summation order, not the GPU's:
    the GPU sweep checks it.)"""
    x, wg, _, _ = ktu.inputs(512, 128, 512, active=12, heavy=0.02, seed=2)
    base = gate_pack_mgpu.gate_pack(x, wg, interpret=self.INTERPRET)
    got = gate_pack_mgpu.gate_pack(x, wg, config=gate_pack_mgpu.GateConfig(**kw),
                                   interpret=self.INTERPRET)
    for a, b in zip(got, base):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_fewer_k_steps_than_stages(self):
    """D = 128 is two K steps of 64 against three SMEM stages, with four tiles per CTA: the
    refills must not run past the next tile (they once loaded the wrong tile's operands)."""
    x, wg, _, _ = ktu.inputs(2048, 128, 512, active=8.0, heavy=0.02, seed=4)
    self._check_against_dense(x, wg, *gate_pack_mgpu.gate_pack(x, wg, interpret=self.INTERPRET))

  def test_config_rejects_unsupported_schedules(self):
    for kw in (dict(max_concurrent_steps=4), dict(tile_k=32, max_concurrent_steps=7),
               dict(max_concurrent_steps=0), dict(tile_k=128), dict(pack_chunk=32),
               dict(packer_row_max="scan"), dict(compression=3)):
      with self.assertRaises(ValueError):
        gate_pack_mgpu.GateConfig(**kw)

  def test_rejects_unaligned_shapes(self):
    x, wg, _, _ = ktu.inputs(130, 128, 512)
    with self.assertRaisesRegex(ValueError, "gate_pack needs"):
      gate_pack_mgpu.gate_pack(x, wg, interpret=self.INTERPRET)

  @parameterized.named_parameters(
      # 8 tiles on the interpreter's 8 CTAs: each checks its rows before its tile.
      dict(testcase_name="before_tiles", m=512, d=128, h=512),
      # 2 tiles: most CTAs have none, so each checks its blocks after the tile loop.
      dict(testcase_name="after_tiles", m=128, d=128, h=512),
      # 16 tiles, 2 per CTA: a CTA's blocks spread over both.
      dict(testcase_name="spread", m=512, d=128, h=1024),
      # 8 tiles, 32 blocks per array: four blocks of each before a CTA's one tile; skewed
      # activity (a feature on 70% of the rows, 90% dead, near-dense rows), whose overflowing
      # tiles make the packer's loops uneven around the check.
      dict(testcase_name="several_per_tile", m=256, d=256, h=1024,
           skew=dict(dead_fraction=0.9, hottest=0.7, row_spread=0.5)))
  def test_weight_check(self, m, d, h, skew=None):
    """The packing warpgroup's NaN / infinity check of other weights: the same words and
    counts, no flag on finite weights, a flag for a NaN, +inf or -inf anywhere in any of
    them (the first and last element of each, and inside: all five places on the skewed
    inputs, three elsewhere)."""
    x, wg, wu, wd = ktu.inputs(m, d, h, active=8.0, heavy=0.02, seed=6, **(skew or {}))
    base = gate_pack_mgpu.gate_pack(x, wg, interpret=self.INTERPRET)
    words, counts, bad = gate_pack_mgpu.gate_pack(x, wg, check=(wu, None, wd),
                                                  interpret=self.INTERPRET)
    np.testing.assert_array_equal(np.asarray(words), np.asarray(base[0]))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(base[1]))
    self.assertFalse(bool(bad))
    size = d * h
    places = [(0, 0, np.nan), (1, size - 1, np.inf), (1, size // 2 + 77, -np.inf),
              (0, size - 1, -np.inf), (1, 0, np.nan)]
    for which, flat, value in places if skew else places[:3]:
      ws = [np.asarray(wu).copy(), np.asarray(wd).copy()]
      ws[which].reshape(-1)[flat] = value
      *_, bad = gate_pack_mgpu.gate_pack(x, wg, check=[jnp.asarray(a) for a in ws],
                                         interpret=self.INTERPRET)
      self.assertTrue(bool(bad), (which, flat, value))

  def test_weight_check_rejects_what_it_cannot_read(self):
    x, wg, wu, wd = ktu.inputs(128, 128, 512)
    with self.assertRaisesRegex(ValueError, "one size"):
      gate_pack_mgpu.gate_pack(x, wg, check=(wu, wd[:256]), interpret=self.INTERPRET)
    with self.assertRaisesRegex(ValueError, "one size"):
      gate_pack_mgpu.gate_pack(x, wg, check=(wu.astype(jnp.float32),),
                               interpret=self.INTERPRET)


class GatePackInterpretTest(GatePackTestBase):
  INTERPRET = True

  def test_no_races_in_the_packing_warpgroup(self):
    """Two tiles per CTA and more K steps than SMEM stages, so the refills, the cross-tile
    loads and the hand-over buffer's reuse all run under the race detector."""
    x, wg, _, _ = ktu.inputs(2048, 256, 512, active=8.0, heavy=0.02, seed=3)
    got = ktu.assert_race_free(lambda p: gate_pack_mgpu.gate_pack(x, wg, interpret=p))
    base = gate_pack_mgpu.gate_pack(x, wg, interpret=True)
    for a, b in zip(got, base):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_no_races_with_a_weight_check(self):
    """The packer's reads of the checked weights and its flag stores, two tiles per CTA."""
    x, wg, wu, wd = ktu.inputs(2048, 128, 512, active=8.0, seed=3)
    *_, bad = ktu.assert_race_free(
        lambda p: gate_pack_mgpu.gate_pack(x, wg, check=(wu, wd), interpret=p))
    self.assertFalse(bool(bad))


class PackedWordsTest(absltest.TestCase):
  """The word layout itself (pure JAX, no kernel): columns past 32767 make a word negative as
  an int32; decoders read the column as an unsigned field."""

  def test_columns_past_32767_decode(self):
    from pallas_kernels import ell_up_down_mgpu  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(3)
    m, n = 8, 129 * 256
    g = np.full((m, n), -1.0, np.float32)
    cols = [[0, 255, 32767, 32768, n - 1], [33000], [], [1, 2, 3], [n - 256], [], [7], [9]]
    for r, js in enumerate(cols):
      g[r, js] = rng.uniform(0.5, 2.0, len(js))
    words, counts = gate_pack_mgpu.pack_reference(jnp.asarray(g))
    self.assertLess(int(jnp.min(words)), 0)
    dense = np.asarray(gate_pack_mgpu.unpack_to_dense(words, counts, n), np.float32)
    want = np.maximum(g, 0).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(dense, want)
    entries, cnt_n, over, _ = ell_up_down_mgpu.ell_from_twell(words, counts, slots=32, width=8)
    got_cols, got_p = ell_up_down_mgpu.split_entries(entries)
    self.assertFalse(bool(jnp.any(over)))
    for r, js in enumerate(cols):
      self.assertEqual(int(cnt_n[r]), len(js))
      np.testing.assert_array_equal(np.asarray(got_cols[r, :len(js)]), js)
      np.testing.assert_array_equal(np.asarray(got_p[r, :len(js)], np.float32), want[r, js])
      self.assertTrue((np.asarray(entries[r, len(js):]) == 0).all())


class ScanPlanTest(parameterized.TestCase):
  """Which blocks each CTA checks (pure Python): together they cover every block."""

  @parameterized.product(blocks=(1, 7, 132, 1000, 1408), num_sms=(1, 8, 132),
                         tiles=(1, 5, 131, 132, 133, 2816))
  def test_every_block_is_checked(self, blocks, num_sms, tiles):
    plan = gate_pack_mgpu._ScanPlan.make(2, blocks, num_sms, tiles)  # pylint: disable=protected-access
    seen = set()
    for sm in range(num_sms):
      local_tiles = len(range(sm, tiles, num_sms))
      if plan.per_tile:
        self.assertGreaterEqual(local_tiles, plan.slots)
        js = range(plan.slots * plan.per_tile)
      else:
        self.assertEqual(plan.slots, 1)
        js = range(plan.per_cta)
      seen.update(min(sm + num_sms * min(j, plan.per_cta - 1), blocks - 1) for j in js)
    self.assertEqual(seen, set(range(blocks)))


class RunTimeColStartErrorsTest(absltest.TestCase):

  def test_bad_run_time_col_starts_are_refused(self):
    """A run-time col_start known at the call is checked like a Python int; the weight
    check needs a static one; a col_start of several values is refused."""
    x = jnp.zeros((128, 64), jnp.bfloat16)
    w = jnp.zeros((64, 512), jnp.bfloat16)
    for bad in (100, 512, -256):
      with self.assertRaisesRegex(ValueError, "multiple of 256"):
        gate_pack_mgpu.gate_pack(x, w, col_start=jnp.int32(bad), interpret=True)
    with self.assertRaisesRegex(ValueError, "Python int col_start"):
      gate_pack_mgpu.gate_pack(x, w, col_start=jnp.int32(256),
                               check=(jnp.zeros((64, 64), jnp.bfloat16),), interpret=True)
    with self.assertRaisesRegex(ValueError, "one int32"):
      gate_pack_mgpu.gate_pack(x, w, col_start=jnp.zeros((2,), jnp.int32), interpret=True)


class GatePackLoweringTest(parameterized.TestCase):

  def test_lowers_for_cuda(self):
    x, wg, _, _ = ktu.inputs(256, 256, 512)
    ktu.lower_for_cuda(gate_pack_mgpu.gate_pack, x, wg)

  def test_lowers_for_cuda_with_a_weight_check(self):
    x, wg, wu, wd = ktu.inputs(256, 256, 512)
    ktu.lower_for_cuda(lambda *a: gate_pack_mgpu.gate_pack(a[0], a[1], check=a[2:]),
                       x, wg, wu, wd)


@pytest.mark.gpu
class GatePackGpuTest(GatePackTestBase):
  INTERPRET = False


if __name__ == "__main__":
  absltest.main()
