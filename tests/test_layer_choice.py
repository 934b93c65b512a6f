"""Tests for the per-layer hot features: the choice from the feature counts, and the trainer
changing them at run time (deterministically, resuming with the choice)."""

import json
import os
import re

from absl.testing import absltest
import numpy as np

import train_test_util as tu
from twell_jax import features
from train import layer_choice
from train import train_lib


class LayerChoiceTest(absltest.TestCase):

  def test_starts_at_all_features_hot_and_describes(self):
    c = layer_choice.LayerChoice(3, 1000)
    self.assertEqual(c.menu, features.hot_choices(1000))
    self.assertEqual(c.hot_features, (1024,) * 3)      # all of H (padded): the dense work
    self.assertEqual(c.describe(), "D D D")
    self.assertEqual(c.sparse_layers, 0)
    self.assertEqual(c.describe([0, 512, 1024]), "S S512 D")
    # Off-menu counts run the next entry up, past the menu its largest.
    self.assertEqual(layer_choice.LayerChoice(2, 1000, hot=[300, 5000]).hot, [512, 1024])

  def test_bad_settings_and_shapes(self):
    with self.assertRaisesRegex(ValueError, "d_ff"):
      layer_choice.LayerChoice(2, 0)
    c = layer_choice.LayerChoice(2, 64)
    with self.assertRaisesRegex(ValueError, "for 2 layers"):
      c.update_from_counts(np.zeros((3, 64)), 100)
    with self.assertRaisesRegex(ValueError, "32 features for d_ff=64"):
      c.update_from_counts(np.zeros((2, 32)), 100)

  def test_cost_model_reproduces_its_benchmark_points(self):
    """The static-K training model against the H100 kernel benchmark it is fitted to (module
    docstring): within 0.05 at each point; the run-time K's hot column costs a third more."""
    h = 5632
    cost = layer_choice.STATIC_TRAINING_COST
    for k, tail, measured in ((1024, 0, 0.528), (2048, 0, 0.752), (3328, 0, 0.977),
                              (0, 30.6, 0.729)):
      self.assertAlmostEqual(float(cost.ratio(h, k, tail)), measured, delta=0.05)
    # A hot column is worth more than a gathered entry of 1% of the tokens in training.
    self.assertGreater(cost.break_even, 0.01)
    self.assertAlmostEqual(layer_choice.TRAINING_COST.hot, cost.hot * 4 / 3)

  def test_inference_threshold_is_below_the_training_one(self):
    # The inference forward saves no backward: it wins at fewer active features only.
    # d_ff 5632, no hot features: inference is predicted below 0.9 up to 32 active per token,
    # training up to 43.
    active = [10.0, 30.0, 40.0, 50.0]
    infer = layer_choice.inference_implementations(active, 5632, sparse="xla")
    self.assertEqual(infer, ("xla", "xla", "dense", "dense"))
    self.assertEqual(layer_choice.describe_implementations(infer, [256, 0, 0, 0]),
                     "S256 S D D")
    train = layer_choice.STATIC_TRAINING_COST.ratio(5632, 0, active)
    self.assertEqual(list(train < 0.9), [True, True, True, False])
    # A shape where the kernels measured slower than dense: every layer dense.
    self.assertEqual(layer_choice.inference_implementations([0.5], 2816, d_model=768,
                                                            tokens=8192), ("dense",))

  def test_a_layer_with_most_features_active_runs_the_dense_ffn(self):
    """5120 of 5632 features on 3% of the tokens each: gathering them or computing them as
    hot columns beside the kernels costs more than the dense FFN (the menu's last entry)."""
    tokens, h = 10_000, 5632
    counts = np.zeros((1, h), np.int64)
    counts[0, :5120] = 300
    c = layer_choice.LayerChoice(1, h)
    c.hot = [0]
    c.update_from_counts(counts, tokens)
    self.assertEqual(c.hot, [h])
    self.assertEqual(c.predicted[0], layer_choice.DENSE_RATIO)
    self.assertEqual(c.describe(), "D")

  def test_rows_over_the_ell_width_weigh_in(self):
    """60 active per token on a few hundred hot features, K = 512 predicted cheapest; with a
    tenth of the rows over the ELL width at K <= 512 the tail pays for them (K = 768, where
    they fit); with a fifth over at every K of the sparse menu (beyond the tail's R = M / 8),
    the dense FFN."""
    tokens, h = 16384, 5632
    counts = np.zeros((1, h), np.int64)
    counts[0, :400] = tokens // 8
    counts[0, 400:2400] = tokens // 200
    c = layer_choice.LayerChoice(1, h)
    c.update_from_counts(counts, tokens)
    self.assertEqual(c.hot, [512])
    heavy = np.zeros((1, 22))
    heavy[0, :3] = tokens // 10
    c.update_from_counts(counts, tokens, heavy)
    self.assertEqual(c.hot, [768])
    heavy[0, :13] = tokens // 5
    c.update_from_counts(counts, tokens, heavy)
    self.assertEqual(c.describe(), "D")

  def test_counts_choose_hot_features_and_sort_them_first(self):
    """A layer of 105 active per token, 100 of them on 300 features that fire on a third of
    the tokens, runs 512 hot; a uniform layer of 30 runs none; one of 200 uniform (every
    feature above the break-even rate) runs all. The order puts the hottest features first.
    K moves only when the new one improves the prediction by more than HOT_CHANGE_GAIN."""
    rng = np.random.default_rng(0)
    tokens, h = 10_000, 5632
    skewed = np.zeros(h, np.int64)
    hot_ids = rng.choice(h, 300, replace=False)
    skewed[hot_ids] = tokens // 3 + rng.integers(0, 100, 300)
    skewed[np.setdiff1d(np.arange(h), hot_ids)] = 5 * tokens // (h - 300)
    counts = np.stack([skewed, np.full(h, 30 * tokens // h), np.full(h, 200 * tokens // h)])
    c = layer_choice.LayerChoice(3, h)
    changed, order = c.update_from_counts(counts, tokens)
    self.assertTrue(changed)
    self.assertEqual(c.hot_features, (512, 0, h))
    self.assertEqual(c.describe(), "S512 S D")
    self.assertEqual(c.sparse_layers, 2)
    self.assertEqual(set(order[0, :300]), set(hot_ids))
    np.testing.assert_array_equal(np.diff(counts[0][order[0]]) <= 0, True)
    self.assertFalse(c.update_from_counts(counts, tokens)[0])
    # 600 hot features need 768, which improves the prediction by about 0.3 (300 features
    # on a third of the tokens leave the gathers).
    more = counts.copy()
    more[0, order[0, 300:600]] = tokens // 3
    self.assertTrue(c.update_from_counts(more, tokens)[0])
    self.assertEqual(c.hot[0], 768)

  def test_long_columns_run_hot(self):
    """1.5 active per token, one feature on almost every token: gathering is predicted cheap,
    but that feature's column would outlast the backward's column kernels: K = 256."""
    tokens, h = 16384, 5632
    counts = np.zeros((1, h), np.int64)
    counts[0, 0] = tokens - 10
    counts[0, 1:400] = tokens // 2 // 400
    c = layer_choice.LayerChoice(1, h)
    c.update_from_counts(counts, tokens)
    self.assertEqual(c.hot, [256])

  def test_nearly_equal_choices_do_not_flap(self):
    """768 features on a third of the tokens and 256 at the break-even rate: K = 768 and 1024
    predict the same, and neither moves to the other (a gain under HOT_CHANGE_GAIN)."""
    tokens, h = 10_000, 5632
    c = layer_choice.LayerChoice(1, h)
    counts = np.zeros((1, h), np.int64)
    counts[0, :768] = tokens // 3
    counts[0, 768:1024] = round(tokens * c.cost.break_even)
    for k in (768, 1024):
      c.hot = [k]
      self.assertFalse(c.update_from_counts(counts, tokens)[0])
      self.assertEqual(c.hot, [k])


class TrainerSwitchTest(tu.FastCompile, absltest.TestCase):

  def _rows(self, wd):
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      return [r for r in map(json.loads, f) if "sparse_layers" in r]

  def _decisions(self, logs):
    """[(step, choice)] of the trainer's 'hot features per layer -> ...' lines."""
    out = []
    for line in logs.output:
      m = re.search(r"step (\d+): hot features per layer -> ([SD0-9 ]+?) \(", line)
      if m:
        out.append((int(m.group(1)), m.group(2)))
    return out

  def test_same_seed_same_decisions_landing_on_the_next_step(self):
    """Two runs with one seed make the same decisions on the same steps, and each lands on
    the step after its decision (the logged hot features of step n + 1 are the choice made
    at step n): no build, no thread decides when. The micro model starts at half its
    features active, on the dense FFN; L1 brings activity down and the layers' K follow it
    (a cost model that goes sparse at micro scale: the real one, scaled to d_model 32, never
    would)."""
    self.enter_context(absltest.mock.patch.object(
        layer_choice.LayerChoice, "predict",
        lambda self, hot, tail, heavy=0.0: np.where(
            np.asarray(hot) >= self.all_hot, 1.0,
            0.2 + np.asarray(hot) / self.d_ff + 8 * np.asarray(tail) / self.d_ff)))
    cfg = tu.micro_config(num_train_steps=12, log_every=1, checkpoint_every=0, l1_coeff=3e-2,
                          learning_rate=3e-3,
                          **{"model.d_ff": 1024, "layer_choice.sparse": "xla",
                             "layer_choice.every": 2})
    runs = []
    for _ in range(2):
      wd = self.create_tempdir().full_path
      with self.assertLogs(level="INFO") as logs:
        train_lib.train_and_evaluate(cfg, wd)
      rows = {r["step"]: [int(r[f"hot_features/layer_{l}"]) for l in range(cfg.model.n_layers)]
              for r in self._rows(wd)}
      runs.append((self._decisions(logs), rows))
    (decisions, rows), (decisions2, rows2) = runs
    self.assertEqual(decisions, decisions2)
    self.assertEqual(rows, rows2)
    self.assertNotEmpty(decisions)
    self.assertEqual(rows[1], [1024] * cfg.model.n_layers)    # all hot from initialisation
    for step, choice in decisions:
      if step + 1 in rows:
        self.assertEqual(layer_choice.LayerChoice(cfg.model.n_layers, 1024).describe(
            rows[step + 1]), choice)
    self.assertTrue(any(k < 1024 for k in rows[max(rows)]))   # some layer gathers by the end

  def test_choice_resumes_from_the_checkpoint(self):
    wd = self.create_tempdir().full_path
    # Every K predicted alike but K = 0 cheapest: the first decision (after step 1) sets all
    # layers to gather everything.
    self.enter_context(absltest.mock.patch.object(
        layer_choice.LayerChoice, "predict",
        lambda self, hot, tail, heavy=0.0: np.asarray(hot, np.float64) * 1e-3))
    cfg = tu.micro_config(num_train_steps=4, log_every=1, checkpoint_every=2,
                          **{"layer_choice.sparse": "xla"})
    train_lib.train_and_evaluate(cfg, wd)
    n = cfg.model.n_layers
    self.assertEqual([r["sparse_layers"] for r in self._rows(wd)], [0, n, n, n])
    self.assertEqual(self._rows(wd)[-1]["hot_features/layer_0"], 0)
    # Resumed: the checkpoint's choice runs from the first step on.
    cfg.num_train_steps = 5
    train_lib.train_and_evaluate(cfg, wd, accept_config_change=True)
    self.assertEqual(self._rows(wd)[-1]["sparse_layers"], n)

  def test_resumed_run_decides_and_sorts_on_the_same_steps(self):
    """A run resumed from step 2 ends with the uninterrupted run's state, bit for bit: its
    decisions (each sorts the features of the state) fall on the same steps. (A decision on
    the resumed run's first step sorted by that step's counts alone, and the two states then
    held the same model with its features in different orders.)"""
    import shutil  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    from train import checkpointing  # pylint: disable=g-import-not-at-top
    cfg = tu.micro_config(num_train_steps=6, checkpoint_every=2, keep_checkpoints=3,
                          **{"layer_choice.sparse": "xla", "layer_choice.every": 4})
    ref, run = self.create_tempdir().full_path, self.create_tempdir().full_path
    train_lib.train_and_evaluate(cfg, ref)
    train_lib.train_and_evaluate(cfg, run)
    for step in (4, 6):   # as if killed after the checkpoint of step 2
      shutil.rmtree(os.path.join(checkpointing.checkpoint_dir(run), str(step)))
    with self.assertLogs(level="INFO") as logs:
      train_lib.train_and_evaluate(cfg, run)
    self.assertTrue(any("Resumed from checkpoint step 2" in line for line in logs.output))
    tr = train_lib.Trainer(cfg)
    states = []
    for wd in (ref, run):
      mngr = checkpointing.make_manager(wd, read_only=True)
      import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
      states.append(jax.device_get(mngr.restore(6, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(tr.abstract_state()))).state))
      mngr.close()
    self.assertTrue(tu.tree_equal(*states))

  def test_sorting_the_state_keeps_the_function_and_the_optimizer_matched(self):
    """Trainer.sort_features permutes each layer's hidden features in the parameters, the
    AdamW moments and the dead-feature counters alike: the loss and the next step's update
    are those of the unpermuted state (up to the order of sums)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    cfg = tu.micro_config()
    tr = train_lib.Trainer(cfg)
    state = tr.new_state(jax.random.key(0))
    batch = tr.put_batch(np.random.default_rng(0).integers(
        0, 200, (1, cfg.batch_size, cfg.data.seq_len + 1), np.int32), tr.batch_sharding)
    step = tr.jit_train_step()
    state, _ = step(state, batch)        # non-zero moments
    l, h = cfg.model.n_layers, cfg.model.d_ff
    order = np.stack([np.random.default_rng(i).permutation(h) for i in range(l)]).astype(np.int32)
    since = np.asarray(state["since"])
    ref_state, ref_m = step(jax.tree.map(jnp.copy, state), batch)
    sorted_state = tr.sort_features(jax.tree.map(jnp.copy, state), order)
    np.testing.assert_array_equal(np.asarray(sorted_state["since"]),
                                  np.take_along_axis(since, order, 1))
    new_state, m = step(sorted_state, batch)
    self.assertAlmostEqual(float(m["loss"]), float(ref_m["loss"]), places=4)
    np.testing.assert_array_equal(np.asarray(m["feature_counts"]),
                                  np.take_along_axis(np.asarray(ref_m["feature_counts"]),
                                                     order, 1))
    back = np.argsort(order, axis=1).astype(np.int32)
    restored = tr.sort_features(new_state, back)
    for a, b in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(ref_state["params"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)

  def test_no_choice_for_an_explicit_implementation_or_a_dense_auto(self):
    cfg = tu.micro_config(**{"model.ffn_implementation": "xla"})
    self.assertIsNone(train_lib.Trainer(cfg).layer_choice())
    cfg = tu.micro_config(**{"layer_choice.enabled": False})
    self.assertIsNone(train_lib.Trainer(cfg).layer_choice())
    cfg = tu.micro_config()   # auto resolves to dense on the CPU: nothing to choose
    self.assertIsNone(train_lib.Trainer(cfg).layer_choice())


if __name__ == "__main__":
  absltest.main()
