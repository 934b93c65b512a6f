"""Tests for the per-layer FFN choice: the hysteresis, the background-compiled steps and the
trainer switching layers to the sparse implementation (and resuming with the choice)."""

import json
import os
import threading
import time

from absl.testing import absltest

import train_test_util as tu
from train import layer_choice
from train import train_lib


class LayerChoiceTest(absltest.TestCase):

  def test_hysteresis(self):
    c = layer_choice.LayerChoice(3, sparse="xla", sparse_below=40, dense_above=56)
    self.assertEqual(c.describe(), "DDD")              # dense from the start
    self.assertTrue(c.update([39.9, 40.0, 100.0]))
    self.assertEqual(c.implementations, ("xla", "dense", "dense"))
    # Between the thresholds nothing moves, either way.
    self.assertFalse(c.update([50.0, 50.0, 50.0]))
    self.assertEqual(c.describe(), "SDD")
    self.assertTrue(c.update([56.1, 10.0, 10.0]))
    self.assertEqual(c.describe(), "DSS")
    self.assertEqual(c.describe(("xla", "xla", "dense")), "SSD")

  def test_bad_settings_and_shapes(self):
    with self.assertRaisesRegex(ValueError, "sparse_below"):
      layer_choice.LayerChoice(2, sparse_below=60, dense_above=50)
    c = layer_choice.LayerChoice(2)
    with self.assertRaisesRegex(ValueError, "3 layers' activity for 2 layers"):
      c.update([1.0, 2.0, 3.0])

  def test_inference_threshold_is_below_the_training_one(self):
    # The inference forward has no hot-column GEMMs: it wins at lower activity only.
    active = [10.0, 47.0, 60.0, 85.0]
    infer = layer_choice.LayerChoice.for_inference(active, sparse="xla")
    self.assertEqual(infer.describe(), "SSDD")
    train = layer_choice.LayerChoice(4, sparse="xla")
    train.update(active)
    self.assertEqual(train.describe(), "SSSS")


class BackgroundStepsTest(absltest.TestCase):

  def _wait(self, steps):
    deadline = time.time() + 10
    while (handed := steps.ready()) is None and time.time() < deadline:
      time.sleep(0.01)
    return handed

  def test_request_hands_over_when_built_and_keeps_executables(self):
    gate, built = threading.Event(), []

    def build(names):
      gate.wait(10)
      built.append(names)
      return f"step{names}"

    steps = layer_choice.BackgroundSteps(build)
    try:
      steps.request(("a",))
      self.assertIsNone(steps.ready())                  # still compiling: keep going
      gate.set()
      self.assertEqual(self._wait(steps), (("a",), "step('a',)"))
      self.assertIsNone(steps.ready())                  # handed over once
      steps.request(("a",))                             # built before: no second build
      self.assertEqual(steps.ready(), (("a",), "step('a',)"))
      self.assertEqual(built, [("a",)])
    finally:
      steps.close()

  def test_newer_requests_supersede_queued_ones(self):
    gate, built = threading.Event(), []

    def build(names):
      gate.wait(10)
      built.append(names)
      return names[0]

    steps = layer_choice.BackgroundSteps(build)
    try:
      steps.request(("a",))          # starts building
      time.sleep(0.1)
      steps.request(("b",))          # queued ...
      steps.request(("c",))          # ... and replaced before it starts
      gate.set()
      # "a" (in flight) is handed over when built, then "c"; "b" is never built.
      first = self._wait(steps)
      if first == (("a",), "a"):
        first = self._wait(steps)
      self.assertEqual(first, (("c",), "c"))
      self.assertEqual(built, [("a",), ("c",)])
    finally:
      steps.close()

  def test_foreground_builds_in_request(self):
    steps = layer_choice.BackgroundSteps(lambda names: names[0], background=False)
    steps.request(("b",))
    self.assertEqual(steps.ready(), (("b",), "b"))
    steps.close()


class TrainerSwitchTest(tu.FastCompile, absltest.TestCase):

  def _rows(self, wd):
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      return [r for r in map(json.loads, f) if "sparse_layers" in r]

  def test_layers_switch_to_sparse_and_resume_with_the_choice(self):
    wd = self.create_tempdir().full_path
    # Every layer fires on far fewer than 1e9 features per token: all switch at the first
    # decision (after step 1); the foreground build lands the switch on that step.
    cfg = tu.micro_config(num_train_steps=4, log_every=1, checkpoint_every=2,
                          **{"layer_choice.sparse": "xla", "layer_choice.sparse_below": 1e9,
                             "layer_choice.dense_above": 1e9,
                             "layer_choice.background": False})
    with self.assertLogs(level="INFO") as logs:
      train_lib.train_and_evaluate(cfg, wd)
    n = cfg.model.n_layers
    self.assertEqual([r["sparse_layers"] for r in self._rows(wd)], [0, n, n, n])
    self.assertTrue(any("ffn " + "S" * n in line for line in logs.output))
    # Resumed: the checkpoint's choice runs from the first step on.
    cfg.num_train_steps = 5
    train_lib.train_and_evaluate(cfg, wd, accept_config_change=True)
    self.assertEqual(self._rows(wd)[-1]["sparse_layers"], n)

  def test_no_choice_for_an_explicit_implementation_or_a_dense_auto(self):
    cfg = tu.micro_config(**{"model.ffn_implementation": "xla"})
    self.assertIsNone(train_lib.Trainer(cfg).layer_choice())
    cfg = tu.micro_config(**{"layer_choice.enabled": False})
    self.assertIsNone(train_lib.Trainer(cfg).layer_choice())
    cfg = tu.micro_config()   # auto resolves to dense on the CPU: nothing to choose
    self.assertIsNone(train_lib.Trainer(cfg).layer_choice())


if __name__ == "__main__":
  absltest.main()
