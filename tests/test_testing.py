"""The input generator (twell_jax.testing): calibrated activity and its statistics."""

from __future__ import annotations

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from twell_jax import testing


def _activity(x, wg):
  return np.asarray(jnp.dot(x.astype(jnp.float32), wg.astype(jnp.float32)) > 0)


class GeneratorTest(absltest.TestCase):

  def test_feature_rates(self):
    q = testing.feature_rates(1000, 20.0, dead_fraction=0.9, hottest=0.7)
    self.assertAlmostEqual(q.sum(), 20.0, places=3)
    self.assertAlmostEqual(q[0], 0.7)
    self.assertEqual(int((q > 0).sum()), 100)
    np.testing.assert_array_equal(np.diff(q[:100]) <= 0, True)
    u = testing.feature_rates(1000, 20.0)
    np.testing.assert_allclose(u, 0.02)

  def test_skewed_inputs_reproduce_their_statistics(self):
    x, wg, _, _ = testing.ffn_inputs(jax.random.key(0), 4096, 256, 1024, active_fraction=0.02,
                                     dead_fraction=0.9, hottest=0.7, dtype=jnp.float32)
    st = testing.activity_stats(_activity(x, wg))
    self.assertGreaterEqual(st["dead_fraction"], 0.9 - 1e-9)
    self.assertLess(st["dead_fraction"], 0.93)
    self.assertAlmostEqual(st["hottest_fraction"], 0.7, delta=0.05)
    self.assertAlmostEqual(st["active_per_token"], 20.48, delta=2.5)
    self.assertGreater(st["top10pct_share"], 0.99)

  def test_row_spread_makes_heavy_tails_and_empty_rows_are_empty(self):
    x, wg, _, _ = testing.ffn_inputs(jax.random.key(1), 4096, 256, 1024, active_fraction=0.02,
                                     row_spread=0.6, empty_fraction=0.01, dtype=jnp.float32)
    act = _activity(x, wg)
    st = testing.activity_stats(act)
    self.assertGreater(st["row_p99"], 3 * st["row_p50"])
    self.assertEqual(int((act.sum(1) == 0).sum()) >= 41, True)

  def test_heavy_rows_fire_half_of_the_alive_features(self):
    x, wg, _, _ = testing.ffn_inputs(jax.random.key(2), 512, 256, 1024, active_fraction=0.02,
                                     heavy_fraction=0.05, dead_fraction=0.5, hottest=0.6,
                                     dtype=jnp.float32)
    rows = np.sort(_activity(x, wg).sum(1))[::-1]
    self.assertGreater(rows[20], 0.3 * 512)
    self.assertLess(rows[0], 512)     # dead features never fire, heavy rows included

  def test_rejects_bad_fraction(self):
    with self.assertRaisesRegex(ValueError, "active_fraction"):
      testing.ffn_inputs(jax.random.key(0), 8, 8, 8, active_fraction=1.5)


if __name__ == "__main__":
  absltest.main()
