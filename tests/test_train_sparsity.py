"""Tests for the L1 term and dead-feature tracking / re-initialization."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import train_test_util as tu
from train.models import transformer as model_lib
from train.state import optim
from train.state import sparsity
from train.state import steps as steps_lib
from train.state import trainer as trainer_lib

class L1AndCountersTest(absltest.TestCase):

  def test_l1_normalizations(self):
    l1 = jnp.array([2.0, 4.0])
    self.assertAlmostEqual(float(sparsity.l1_term(l1, 8, "per_token_sum")), 3)
    self.assertAlmostEqual(
        float(sparsity.l1_term(l1, 8, "per_element_mean")), 3 / 8)
    with self.assertRaises(ValueError):
      sparsity.l1_term(l1, 8, "mean")

  def test_l1_layer_scales_weigh_each_layers_term(self):
    """config.l1_layer_scales multiplies each layer's L1 statistic in the penalty: "" and
    all ones give the same loss, zeros leave the cross-entropy alone, "2,0" counts the first
    layer twice and the second not at all (the mean over the 2 layers)."""
    cfg = tu.micro_config()
    tr = trainer_lib.Trainer(cfg)
    params = tr.new_state(jax.random.key(0))["params"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 259, (4, 33)), jnp.int32)
    out = {}
    for scales in ("", "1,1", "0,0", "2,0"):
      cfg.l1_layer_scales = scales
      loss_fn = steps_lib.make_loss_fn(tr.lm, cfg)
      out[scales] = jax.jit(loss_fn)(params, tokens, 0.5)
    loss, (ce, l1, stats) = out[""]
    self.assertEqual(float(out["1,1"][0]), float(loss))
    self.assertEqual(float(out["0,0"][0]), float(out["0,0"][1][0]))
    self.assertEqual(float(out["0,0"][1][1]), 0.0)
    np.testing.assert_allclose(float(out["2,0"][1][1]), float(stats.l1[0]), rtol=1e-6)
    np.testing.assert_allclose(float(l1), float(jnp.mean(stats.l1)), rtol=1e-6)
    np.testing.assert_allclose(float(loss), float(ce) + 0.5 * float(l1), rtol=1e-6)

  def test_since_counters(self):
    since = sparsity.init_since(2, 3)
    fired = jnp.array([[True, False, False], [False, False, True]])
    since = sparsity.update_since(since, fired, 100)
    np.testing.assert_array_equal(since, [[0, 100, 100], [100, 100, 0]])
    since = sparsity.update_since(since, ~fired, 50)
    np.testing.assert_array_equal(since, [[50, 0, 0], [0, 0, 50]])
    big = sparsity.update_since(jnp.full((1, 1), 2**30 - 1, jnp.int32),
                                jnp.zeros((1, 1), bool), 2**29)
    self.assertEqual(int(big[0, 0]), 2**30)  # saturates, no overflow
    np.testing.assert_array_equal(
        sparsity.dead_mask(since, 50), [[True, False, False],
                                        [False, False, True]])

  def test_l1_schedule_warmup(self):
    cfg = tu.micro_config(l1_coeff=1e-3, l1_warmup_steps=10)
    sched = optim.l1_schedule(cfg)
    self.assertEqual(float(sched(0)), 0.0)
    self.assertAlmostEqual(float(sched(5)), 5e-4)
    self.assertAlmostEqual(float(sched(50)), 1e-3)

  def test_weight_decay_mask_skips_norms(self):
    params = {"embed": jnp.ones((3, 2)), "norm": {"scale": jnp.ones(2)}}
    self.assertEqual(optim.decay_mask(params),
                     {"embed": True, "norm": {"scale": False}})


class DeadReinitTest(tu.FastCompile, parameterized.TestCase):

  @parameterized.named_parameters(("loop", False), ("scan", True))
  def test_forced_dead_gate_column_is_reinitialized(self, scan_layers):
    # Column j of layer 0's gate is zero, so relu(x @ w_gate[:, j]) = 0 for
    # every token: the feature never fires. With a window of one step's
    # tokens and re-init every 2 steps, step 2 must redraw exactly the dead
    # columns and zero their Adam moments.
    cfg = tu.micro_config(dead_reinit=True, dead_reinit_every=2,
                          l1_coeff=0.0, learning_rate=1e-3, warmup_steps=0)
    cfg.dead_window_tokens = cfg.batch_size * cfg.data.seq_len
    cfg.model.scan_layers = scan_layers
    tr = trainer_lib.Trainer(cfg)
    state = tr.init_state(jax.random.key(0))
    j, n_layers = 17, cfg.model.n_layers
    ffn = lambda tree: model_lib.stacked_ffn(tree, n_layers)
    gate = ffn(state["params"])["w_gate"]
    state["params"] = model_lib.with_stacked_ffn(
        state["params"], {"w_gate": gate.at[0, :, j].set(0.0)})
    step = jax.jit(steps_lib.make_train_step(tr.lm, tr.tx, cfg))
    rng = np.random.default_rng(0)
    batch = lambda: jnp.asarray(
        rng.integers(3, 259, (1, cfg.batch_size, cfg.data.seq_len + 1)),
        jnp.int32)
    state, m1 = step(state, batch())
    w1 = ffn(state["params"])["w_gate"][0]
    self.assertTrue(bool(jnp.all(w1[:, j] == 0)))  # no gradient, no decay
    self.assertEqual(int(m1["dead_reinit"]), 0)
    self.assertGreater(float(m1["dead_fraction"][0]), 0)
    dead_before = np.asarray(sparsity.dead_mask(state["since"],
                                                cfg.dead_window_tokens))
    self.assertTrue(dead_before[0, j])
    state, m2 = step(state, batch())
    w2 = ffn(state["params"])["w_gate"][0]
    self.assertGreaterEqual(int(m2["dead_reinit"]), 1)
    col = np.asarray(w2[:, j])
    self.assertTrue(np.all(col != 0))
    self.assertLess(abs(col.std() - 0.02), 0.012)  # drawn from N(0, 0.02^2)
    self.assertEqual(int(state["since"][0, j]), 0)
    adam = state["opt_state"][1][0]  # chain(clip, adamw)[1] -> ScaleByAdam
    for moment in (adam.mu, adam.nu):
      m = ffn(moment)["w_gate"]
      self.assertTrue(bool(jnp.all(m[0, :, j] == 0)))
      self.assertFalse(bool(jnp.all(m[0, :, j + 1] == 0)))  # others kept
    # w_up / w_down of the revived feature are kept, not redrawn.
    self.assertFalse(bool(jnp.all(ffn(state["params"])["w_up"][0, :, j]
                                  == 0)))


if __name__ == "__main__":
  absltest.main()
