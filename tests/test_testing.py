"""The input generator (twell_jax.testing): calibrated activity and its statistics."""

from __future__ import annotations

import json
import os

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from twell_jax import testing

_DATA = os.path.join(os.path.dirname(__file__), "data", "real_activity_h100.json")


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

  def test_feature_rates_with_top_shares(self):
    """A hot head carrying the given shares, then a flat cold tail; sorted, summing to the
    mean activity."""
    q = testing.feature_rates(5632, 40.0, dead_fraction=0.8, hottest=0.9,
                              top_shares=((0.01, 0.45), (0.1, 0.97)))
    self.assertAlmostEqual(q.sum(), 40.0, places=6)
    self.assertAlmostEqual(q[0], 0.9)
    self.assertAlmostEqual(q[:56].sum() / 40.0, 0.45, places=6)
    self.assertAlmostEqual(q[:563].sum() / 40.0, 0.97, places=6)
    np.testing.assert_array_equal(np.diff(q) <= 0, True)
    alive = int(round(0.2 * 5632))
    np.testing.assert_array_equal(q[alive:], 0.0)
    self.assertGreater(q[alive - 1], 0.0)
    np.testing.assert_allclose(q[563:alive], q[alive - 1])   # the cold tail
    with self.assertRaisesRegex(ValueError, "needs hottest"):
      testing.feature_rates(100, 4.0, top_shares=((0.1, 0.5),))

  def test_a_third_anchor_adds_a_warm_segment(self):
    """Past the top 10%, a third anchor's share is carried by a geometric decay from the
    head's last rate; the cold tail past it takes the rest equally. Without it the 90% past
    the head fire at one rate (the shape that overstated a last layer's spread: its real top
    half held 98% of the firings)."""
    shares = ((0.01, 0.09), (0.1, 0.48), (0.5, 0.97))
    q = testing.feature_rates(5632, 200.0, dead_fraction=0.03, hottest=0.6, top_shares=shares)
    self.assertAlmostEqual(q.sum(), 200.0, places=5)
    for frac, share in shares:
      self.assertAlmostEqual(q[:int(round(frac * 5632))].sum() / 200.0, share, places=5)
    np.testing.assert_array_equal(np.diff(q) <= 1e-12, True)
    warm = q[563:2816]
    self.assertGreater(warm[0] / warm[-1], 5.0)         # decays across the segment
    alive = int(round(0.97 * 5632))
    np.testing.assert_allclose(q[2816:alive], q[alive - 1])
    two = testing.feature_rates(5632, 200.0, dead_fraction=0.03, hottest=0.6,
                                top_shares=shares[:2])
    self.assertLess(two[:2816].sum() / 200.0, 0.8)     # flat past the head

  def test_popularity_follows_a_measured_profile(self):
    """Fitted to the two anchors of a trained run's popularity profile (the features firing on
    more than 10% / 1% of the tokens and their share), the curve between and past them
    predicts how many features fire on more than 10/5/2/1% of the tokens. The profile does
    not record the hottest feature; the counts barely depend on it."""
    with open(_DATA) as f:
      profile = json.load(f)["forward_profile"]
    h = profile["h"]
    for layer, rec in enumerate(profile["layers"]):
      above = {float(t): v for t, v in rec["above"].items()}
      anchors = tuple((above[t][0] / h, above[t][1]) for t in (0.1, 0.01))
      for hottest in (0.7, 1.0):
        q = testing.feature_rates(h, rec["active_per_token"], hottest=hottest,
                                  top_shares=anchors)
        for t in (0.1, 0.05, 0.02, 0.01):
          n, share = above[t]
          got = int((q > t).sum())
          msg = f"layer {layer} hottest {hottest}: features above {t}"
          self.assertLess(abs(got - n), 0.3 * n, msg)
          self.assertLess(abs(q[:got].sum() / q.sum() - share), 0.07, msg)

  def test_skewed_inputs_reproduce_their_statistics(self):
    x, wg, _, _ = testing.ffn_inputs(jax.random.key(0), 4096, 256, 1024, active_fraction=0.02,
                                     dead_fraction=0.9, hottest=0.7, dtype=jnp.float32)
    st = testing.activity_stats(_activity(x, wg))
    self.assertGreaterEqual(st["dead_fraction"], 0.9 - 1e-9)
    self.assertLess(st["dead_fraction"], 0.93)
    self.assertAlmostEqual(st["hottest_fraction"], 0.7, delta=0.05)
    self.assertAlmostEqual(st["active_per_token"], 20.48, delta=2.5)
    self.assertGreater(st["top10pct_share"], 0.99)

  def test_generated_batch_carries_the_top_shares(self):
    """Sampled: the shares, hottest feature, dead fraction and mean of a head + tail curve,
    with a row spread (the thresholds keep each feature's rate whatever the spread)."""
    x, wg, _, _ = testing.ffn_inputs(jax.random.key(3), 4096, 64, 2048, active_fraction=0.01,
                                     dead_fraction=0.7, hottest=0.9,
                                     top_shares=((0.01, 0.4), (0.1, 0.95)), row_spread=0.8,
                                     dtype=jnp.float32)
    st = testing.activity_stats(_activity(x, wg))
    self.assertAlmostEqual(st["active_per_token"], 0.01 * 2048, delta=0.05 * 0.01 * 2048)
    self.assertAlmostEqual(st["top1pct_share"], 0.4, delta=0.03)
    self.assertAlmostEqual(st["top10pct_share"], 0.95, delta=0.03)
    self.assertAlmostEqual(st["hottest_fraction"], 0.9, delta=0.03)
    self.assertAlmostEqual(st["dead_fraction"], 0.7, delta=0.03)
    self.assertGreater(st["row_p99"], 3 * st["row_p50"])

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

  def test_heavy_fill_sets_how_full_heavy_rows_are(self):
    for fill in (0.1, 0.9, 0.99):
      x, wg, _, _ = testing.ffn_inputs(jax.random.key(4), 256, 64, 2048, active_fraction=0.01,
                                       heavy_fraction=0.02, heavy_fill=fill, dead_fraction=0.6,
                                       hottest=0.9, top_shares=((0.01, 0.5), (0.1, 0.95)),
                                       row_spread=0.3, dtype=jnp.float32)
      act = _activity(x, wg)
      alive = int(round(0.4 * 2048))
      heavy = np.sort(act.sum(1))[::-1][:6]                     # ceil(0.02 * 256) rows
      np.testing.assert_allclose(heavy / alive, fill, atol=0.05, err_msg=f"fill {fill}")
      self.assertLessEqual(int(act.any(0).sum()), alive)         # dead features stay dead

  def test_deterministic_in_the_key(self):
    kw = dict(active_fraction=0.01, dead_fraction=0.5, hottest=0.9,
              top_shares=((0.01, 0.4), (0.1, 0.9)), row_spread=0.4, heavy_fraction=0.01,
              heavy_fill=0.8)
    a = testing.ffn_inputs(jax.random.key(7), 64, 32, 512, **kw)
    b = testing.ffn_inputs(jax.random.key(7), 64, 32, 512, **kw)
    c = testing.ffn_inputs(jax.random.key(8), 64, 32, 512, **kw)
    for u, v in zip(a, b):
      np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
    self.assertFalse(np.array_equal(np.asarray(a[0], np.float32), np.asarray(c[0], np.float32)))

  def test_rejects_bad_arguments(self):
    with self.assertRaisesRegex(ValueError, "active_fraction"):
      testing.ffn_inputs(jax.random.key(0), 8, 8, 8, active_fraction=1.5)
    with self.assertRaisesRegex(ValueError, "heavy_fill"):
      testing.ffn_inputs(jax.random.key(0), 8, 8, 8, heavy_fill=2.0)
    with self.assertRaisesRegex(ValueError, "d must be"):
      testing.ffn_inputs(jax.random.key(0), 8, 2, 8)


if __name__ == "__main__":
  absltest.main()
