"""twell_jax.features: popularity order, the hot-feature count and calibration."""

from __future__ import annotations

from absl.testing import absltest
import jax
import numpy as np

from twell_jax import features
from twell_jax import testing


class SparseWorkTest(absltest.TestCase):

  def test_tail_work_is_sparse_work_without_the_hot_cost_at_every_k(self):
    """One sort gives what sparse_work(k, break_even=0) gives for each k, unsorted counts and
    k past H included."""
    counts = np.random.default_rng(0).integers(0, 500, 300)
    tail = features.tail_work(counts, 1000)
    self.assertEqual(tail.shape, (301,))
    for k in (0, 1, 7, 256, 299, 300):
      self.assertAlmostEqual(tail[k], features.sparse_work(counts, 1000, k, break_even=0.0),
                             places=9)
    self.assertEqual(tail[-1], 0.0)


class CalibrateTest(absltest.TestCase):

  def _inputs(self, heavy_fraction):
    # 4096 tokens, 0.5% of 1024 features active per ordinary row: under the 1% break-even.
    return testing.ffn_inputs(jax.random.key(3), 4096, 64, 1024, active_fraction=0.005,
                              heavy_fraction=heavy_fraction, heavy_fill=0.8)

  def test_uniform_activity_under_break_even_keeps_every_feature_sparse(self):
    *_, k = features.calibrate(*self._inputs(0.0))
    self.assertEqual(k, 0)

  def test_heavy_rows_do_not_make_features_hot(self):
    """1% of 80%-dense rows lift every feature over 1% of the tokens; the kernels compute
    those rows densely, so counting them would make the whole layer dense."""
    x, wg, wu, wd = self._inputs(0.01)
    *_, k = features.calibrate(x, wg, wu, wd)
    self.assertEqual(k, 0)
    *_, k_all = features.calibrate(x, wg, wu, wd, dense_row_entries=None)
    self.assertGreaterEqual(k_all, 512)

  def test_long_columns_raise_k_for_the_backward_only(self):
    """A layer with 1.2 entries per token, a few features on ~20% of the tokens each: under
    the break-even by cost, but each such column is far over a fair share of the entries,
    which the backward's column kernels would wait on. The inference forward walks rows and
    keeps them sparse."""
    tokens, h = 10000, 4096
    counts = np.zeros(h)
    counts[:4] = 2000                      # 20% of the tokens each: 8000 of 12000 entries
    counts[4:4004] = 1                     # the rest spread thin
    self.assertEqual(features.hot_feature_count(counts, tokens, backward=False), 0)
    self.assertEqual(features.hot_feature_count(counts, tokens), 256)

  def test_rejects_a_negative_row_limit(self):
    with self.assertRaisesRegex(ValueError, "dense_row_entries"):
      features.calibrate(*self._inputs(0.0), dense_row_entries=-1)

  def test_sorted_weights_compute_the_same_function(self):
    x, wg, wu, wd = testing.ffn_inputs(jax.random.key(4), 256, 64, 512, active_fraction=0.05,
                                       dead_fraction=0.5, hottest=0.6)
    sg, su, sd, _ = features.calibrate(x, wg, wu, wd)
    f32 = lambda a: np.asarray(a, np.float32)
    y = lambda g, u, d: (np.maximum(f32(x) @ f32(g), 0) * (f32(x) @ f32(u))) @ f32(d)
    np.testing.assert_allclose(y(sg, su, sd), y(wg, wu, wd), rtol=1e-4, atol=1e-3)
    counts = np.sum(f32(x) @ f32(sg) > 0, axis=0)
    np.testing.assert_array_equal(np.diff(counts) <= 0, True)


if __name__ == "__main__":
  absltest.main()
