"""The TwELL -> ELL conversion kernel (pallas_kernels/twell_to_ell_triton.py) against the XLA
conversion (`ell_up_down_mgpu.ell_from_twell`) and a NumPy reading of the dense-row list.

Records with fixed seeds: a few entries per tile, rows over a tile's slots, rows over the ELL
width, empty rows, padding rows past m, a non-finite weight (every row to the dense path),
a width that is not a power of two, one tile, and the gate kernel's own words.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_test_util as ktu
from pallas_kernels import _common as common
from pallas_kernels import _target as target
from pallas_kernels import ell_up_down_mgpu
from pallas_kernels import gate_pack_mgpu
from pallas_kernels import twell_to_ell_triton as tte


def records(mp: int, t: int, s: int, *, seed: int, heavy: float = 0.05, empty: float = 0.1,
            mean: float = 1.5):
  """(words [mp, t*s], counts [t, mp]) as the gate kernel writes them: per (row, tile) a
  Poisson count, sorted columns in the tile, EMPTY words after them; heavy rows get counts up
  to 3 s (over the slots: all-EMPTY records), empty rows none."""
  rng = np.random.default_rng(seed)
  cnt = rng.poisson(mean, size=(t, mp)).astype(np.int32)
  heavy_rows = rng.random(mp) < heavy
  cnt[:, heavy_rows] = rng.integers(0, 3 * s, size=(t, heavy_rows.sum()))
  cnt[:, rng.random(mp) < empty] = 0
  words = np.full((mp, t * s), common.EMPTY_WORD, np.int32)
  for r in range(mp):
    for tile in range(t):
      c = cnt[tile, r]
      if c <= s:
        cols = np.sort(rng.choice(256, size=c, replace=False)) + tile * 256
        words[r, tile * s:tile * s + c] = (cols << 16) | rng.integers(1, 0x7F00, size=c)
  return jnp.asarray(words), jnp.asarray(cnt)


class ConvertTest(parameterized.TestCase):

  def check(self, words, counts, *, m, slots, width, nonfinite=False, config=None):
    got = tte.twell_to_ell(words, counts, jnp.bool_(nonfinite), m=m, slots=slots, width=width,
                           config=config or tte.ConvertConfig(), interpret=True)
    entries, n, pos, rows, tally = map(np.asarray, got)
    ref_entries, ref_n, ref_over, _ = map(np.asarray, ell_up_down_mgpu.ell_from_twell(
        words, counts, slots=slots, width=width))
    mp = words.shape[0]
    take = (ref_over | nonfinite) & (np.arange(mp) < m)
    want_n = np.where(take, 0, ref_n)
    np.testing.assert_array_equal(n, want_n)
    self.assertEqual(entries.shape, (mp, tte.entry_slots(width)))
    want = np.zeros_like(entries)
    want[:, :width] = np.where(np.arange(width)[None, :] < want_n[:, None], ref_entries, 0)
    np.testing.assert_array_equal(entries, want)
    # The dense-row list: each taken row once, pos its slot; the tally counts it and the rows
    # over capacity below m.
    self.assertEqual(int(tally[0]), int(take.sum()))
    self.assertEqual(int(tally[1]), int((ref_over & (np.arange(mp) < m)).sum()))
    np.testing.assert_array_equal(pos >= 0, take)
    self.assertCountEqual(rows[:int(tally[0])].tolist(), np.flatnonzero(take).tolist())
    for r in np.flatnonzero(take):
      self.assertEqual(rows[pos[r]], r)
    return take

  @parameterized.named_parameters(
      dict(testcase_name="paper_tiles", mp=128, t=22, s=32, width=128, m=128),
      dict(testcase_name="padding_rows", mp=256, t=5, s=32, width=128, m=200, heavy=0.1),
      dict(testcase_name="narrow_width", mp=64, t=7, s=8, width=20, m=64, mean=3.0),
      dict(testcase_name="one_tile", mp=32, t=1, s=32, width=128, m=5, heavy=0.5),
      dict(testcase_name="all_heavy", mp=32, t=3, s=4, width=6, m=32, heavy=1.0, empty=0.0),
  )
  def test_matches_the_xla_conversion(self, mp, t, s, width, m, heavy=0.05, empty=0.1,
                                      mean=1.5):
    words, counts = records(mp, t, s, seed=mp + t, heavy=heavy, empty=empty, mean=mean)
    take = self.check(words, counts, m=m, slots=s, width=width)
    if heavy:
      self.assertGreater(take.sum(), 0)

  @parameterized.parameters(
      dict(rows_per_program=1, num_warps=1, tiles_per_step=8),
      dict(rows_per_program=8, num_warps=2, tiles_per_step=3),
      dict(rows_per_program=32, num_warps=4, tiles_per_step=1))
  def test_schedules_agree(self, **kw):
    words, counts = records(64, 9, 16, seed=3, mean=2.0)
    self.check(words, counts, m=60, slots=16, width=40, config=tte.ConvertConfig(**kw))

  def test_nonfinite_sends_every_row_below_m_to_the_dense_path(self):
    words, counts = records(64, 4, 8, seed=5, heavy=0.0)
    take = self.check(words, counts, m=50, slots=8, width=16, nonfinite=True)
    np.testing.assert_array_equal(take, np.arange(64) < 50)

  @parameterized.named_parameters(
      dict(testcase_name="uniform", skew={}),
      # A feature on 70% of the rows, 90% of the features dead, near-dense rows among the
      # alive ones.
      dict(testcase_name="skewed", skew=dict(dead_fraction=0.9, hottest=0.7, row_spread=0.6)))
  def test_gate_kernel_words(self, skew):
    x, wg, _, _ = ktu.inputs(128, 64, 768, active=12.0, heavy=0.05, seed=2, **skew)
    words, counts = gate_pack_mgpu.gate_pack(x, wg, interpret=True)
    self.check(words, counts, m=120, slots=gate_pack_mgpu.GateConfig().slots, width=64)

  def test_rejects_bad_input(self):
    words, counts = records(32, 2, 8, seed=1)
    with self.assertRaisesRegex(ValueError, "bad shapes"):
      tte.twell_to_ell(words, counts[:1], False, m=32, slots=8, width=8, interpret=True)
    with self.assertRaisesRegex(ValueError, "bad shapes"):
      tte.twell_to_ell(words, counts, False, m=33, slots=8, width=8, interpret=True)
    with self.assertRaisesRegex(ValueError, "power of two"):
      tte.ConvertConfig(rows_per_program=3)
    with self.assertRaisesRegex(ValueError, "num_warps"):
      tte.ConvertConfig(num_warps=3)
    with self.assertRaisesRegex(ValueError, "tiles_per_step"):
      tte.ConvertConfig(tiles_per_step=0)

  def test_lowers_for_cuda(self):
    words, counts = records(256, 22, 32, seed=7, heavy=0.0)
    ktu.lower_for_cuda(lambda w, c: tte.twell_to_ell(w, c, False, m=250, slots=32, width=128),
                       words, counts)


@pytest.mark.gpu
class ConvertGpuTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if not target.on_hopper():
      self.skipTest("needs a Hopper GPU")

  @parameterized.parameters(0.0, 0.05)
  def test_matches_the_xla_conversion_on_the_device(self, heavy):
    words, counts = records(4096, 22, 32, seed=11, heavy=heavy)
    for nonfinite in (False, True):
      got = tte.twell_to_ell(words, counts, jnp.bool_(nonfinite), m=4000, slots=32, width=128)
      entries, n, pos, rows, tally = map(np.asarray, got)
      ref_entries, ref_n, ref_over, _ = map(np.asarray, ell_up_down_mgpu.ell_from_twell(
          words, counts, slots=32, width=128))
      take = (ref_over | nonfinite) & (np.arange(4096) < 4000)
      want_n = np.where(take, 0, ref_n)
      np.testing.assert_array_equal(n, want_n)
      np.testing.assert_array_equal(
          entries, np.where(np.arange(128)[None, :] < want_n[:, None], ref_entries, 0))
      self.assertEqual(int(tally[0]), int(take.sum()))
      self.assertCountEqual(rows[:int(tally[0])].tolist(), np.flatnonzero(take).tolist())
      np.testing.assert_array_equal(rows[pos[take]], np.flatnonzero(take))


if __name__ == "__main__":
  absltest.main()
