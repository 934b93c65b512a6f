"""Tests for the per-layer FFN choice: the hysteresis, the background-compiled steps and the
trainer switching layers to the sparse implementation (and resuming with the choice)."""

import json
import math
import os
import re
import threading
import time

from absl.testing import absltest
import numpy as np
import pytest

import train_test_util as tu
from configs import tiny
from twell_jax import features
from train.config import checks as config_checks
from train.models import implementations
from train.models import layer_choice
from train.models import transformer as model_lib
from train.training import loop as train_lib
from train.runtime import metrics
from train.state import trainer as trainer_lib
from train.training import choice_steps


def _skewed_layer(tokens: int, h: int):
  """A layer's feature counts of 105 active per token, 100 of them on 300 features that fire
  on a third of the tokens, and those 300 features."""
  rng = np.random.default_rng(0)
  skewed = np.zeros(h, np.int64)
  hot_ids = rng.choice(h, 300, replace=False)
  skewed[hot_ids] = tokens // 3 + rng.integers(0, 100, 300)
  skewed[np.setdiff1d(np.arange(h), hot_ids)] = 5 * tokens // (h - 300)
  return skewed, hot_ids


class LayerChoiceTest(absltest.TestCase):

  def test_hysteresis(self):
    c = layer_choice.LayerChoice(3, 1000, sparse_implementation="xla", sparse_below=0.8, dense_above=0.95)
    self.assertEqual(c.describe(), "D D D")            # dense from the start
    self.assertTrue(c.update([0.79, 0.8, 1.2]))
    self.assertEqual(c.implementations, ("xla", "dense", "dense"))
    # Between the thresholds nothing moves, either way.
    self.assertFalse(c.update([0.9, 0.9, 0.9]))
    self.assertEqual(c.describe(), "S D D")
    # Back to dense only at the second decision in a row above dense_above.
    self.assertTrue(c.update([0.96, 0.5, 0.5]))
    self.assertEqual(c.describe(), "S S S")
    self.assertFalse(c.update([0.5, 0.96, 0.5]))      # one decision above: not yet
    self.assertFalse(c.update([0.96, 0.5, 0.5]))      # not two in a row for either
    self.assertTrue(c.update([0.96, 1.2, 0.5]))
    self.assertEqual(c.describe(), "D S S")
    self.assertEqual(c.describe((("xla", "xla", "dense"), (512, 0, 0))), "S512 S D")

  def test_bad_settings_and_shapes(self):
    with self.assertRaisesRegex(ValueError, "sparse_below"):
      layer_choice.LayerChoice(2, 64, sparse_below=0.6, dense_above=0.5)
    with self.assertRaisesRegex(ValueError, "d_ff"):
      layer_choice.LayerChoice(2, 0)
    c = layer_choice.LayerChoice(2, 64)
    with self.assertRaisesRegex(ValueError, "3 layers' activity for 2 layers"):
      c.update([1.0, 2.0, 3.0])
    with self.assertRaisesRegex(ValueError, "32 features for d_ff=64"):
      c.update_from_counts(np.zeros((2, 32)), 100)

  def test_cost_model_reproduces_its_benchmark_points(self):
    """The training model against the H100 kernel benchmark it is fitted to (module
    docstring): within 0.05 at each point."""
    h = 5632
    cost = layer_choice.TRAINING_COST
    for k, tail, measured in ((1024, 0, 0.528), (2048, 0, 0.752), (3328, 0, 0.977),
                              (0, 30.6, 0.729)):
      self.assertAlmostEqual(float(cost.ratio(h, k, tail)), measured, delta=0.05)
    # A hot column is worth more than a gathered entry of 1% of the tokens in training.
    self.assertGreater(cost.break_even, 0.01)

  def test_inference_threshold_is_below_the_training_one(self):
    # The inference forward saves no backward: it wins at fewer active features only.
    # d_ff 5632, no hot features: inference is predicted below 0.9 up to 32 active per token,
    # training up to 43.
    active = [10.0, 30.0, 40.0, 50.0]
    infer = layer_choice.LayerChoice.for_inference(active, 5632, sparse_implementation="xla")
    self.assertEqual(infer.describe(), "S S D D")
    train = layer_choice.LayerChoice(4, 5632, sparse_implementation="xla")
    train.update(train.cost.ratio(5632, 0, active))
    self.assertEqual(train.describe(), "S S S D")

  def test_a_layer_with_most_features_hot_stays_dense(self):
    """5120 of 5632 features on 3% of the tokens each: the best K is 5120, predicted at 1.33
    of dense (the sparse kernels would run 91% of the dense GEMMs plus their own work): the
    layer stays dense."""
    tokens, h = 10_000, 5632
    counts = np.zeros((1, h), np.int64)
    counts[0, :5120] = 300
    c = layer_choice.LayerChoice(1, h, sparse_implementation="xla")
    c.update_from_counts(counts, tokens)
    self.assertEqual(c.hot, [5120])
    self.assertGreater(c.predicted[0], 1.0)
    self.assertEqual(c.describe(), "D")

  def test_counts_choose_hot_features_and_sort_them_first(self):
    """A layer of 105 active per token, 100 of them on 300 features that fire on a third of
    the tokens, is sparse with 512 hot features; a uniform layer of 30 is sparse without;
    one of 200 uniform (every feature above the break-even rate) is dense. The order puts
    the hottest features first. K moves only when the new one improves the prediction by
    more than HOT_CHANGE_GAIN."""
    tokens, h = 10_000, 5632
    skewed, hot_ids = _skewed_layer(tokens, h)
    counts = np.stack([skewed, np.full(h, 30 * tokens // h), np.full(h, 200 * tokens // h)])
    c = layer_choice.LayerChoice(3, h, sparse_implementation="xla")
    changed, order = c.update_from_counts(counts, tokens)
    self.assertTrue(changed)
    self.assertEqual(c.key, (("xla", "xla", "dense"), (512, 0, 0)))
    self.assertEqual(c.describe(), "S512 S D")
    self.assertEqual(set(order[0, :300]), set(hot_ids))
    np.testing.assert_array_equal(np.diff(counts[0][order[0]]) <= 0, True)
    # 280 hot features would fit in 512 too; 600 need 768, which improves the prediction by
    # about 0.3 (88 features on a third of the tokens leave the tail).
    self.assertFalse(c.update_from_counts(counts, tokens)[0])
    more = counts.copy()
    more[0, order[0, 300:600]] = tokens // 3
    self.assertTrue(c.update_from_counts(more, tokens)[0])
    self.assertEqual(c.hot[0], 768)

  def test_a_menu_of_k_raises_each_layer_to_its_next_value(self):
    """`hot_menu`: the layer that takes 512 hot features without a menu takes 1024 with
    (256, 1024, 2048), the uniform one keeps K = 0; a K past the menu's last is kept; the
    config's spec is checked."""
    tokens, h = 10_000, 5632
    counts = np.stack([_skewed_layer(tokens, h)[0], np.full(h, 30 * tokens // h)])
    for menu, want in (((), 512), ((256, 1024, 2048), 1024), ((256,), 512)):
      c = layer_choice.LayerChoice(2, h, sparse_implementation="xla", hot_menu=menu)
      c.update_from_counts(counts, tokens)
      self.assertEqual(c.key, (("xla", "xla"), (want, 0)), menu)
    self.assertEqual(layer_choice.parse_hot_menu(" 1024, 256,,1024"), (256, 1024))
    self.assertEqual(layer_choice.parse_hot_menu(""), ())
    for bad in ("300", "0", "-256", "a"):
      with self.assertRaisesRegex(ValueError, "positive multiple of 256"):
        layer_choice.parse_hot_menu(bad)
    cfg = tiny.get_config()
    cfg.layer_choice.hot_menu = "256,100"
    with self.assertRaisesRegex(ValueError, "layer_choice.hot_menu='256,100'"):
      config_checks.check(cfg, 1, 1)
    cfg.layer_choice.hot_menu = "256,1024"
    config_checks.check(cfg, 1, 1)


class LongColumnsTest(absltest.TestCase):

  def test_a_k_below_the_long_columns_floor_is_never_kept(self):
    """A layer at 1.9 active per token with one feature on 22% of the tokens (the paper
    shape's layer 2 at step 2,500 of a run from initialisation): the linear model predicts
    K = 0 cheapest, but that feature's column would stall the backward's column kernels
    (1.19-1.89x dense measured at K = 0 with one CTA per column), so the choice takes the
    floor, 256; with `column_floor=False`, the model's K = 0. Without long columns K = 0 stays
    allowed."""
    tokens, h = 16384, 5632
    counts = np.zeros((1, h), np.int64)
    counts[0, 0] = int(0.22 * tokens)
    counts[0, 1:100] = int(0.017 * tokens)
    self.assertEqual(features.column_floor(counts[0], tokens), 256)
    c = layer_choice.LayerChoice(1, h)
    self.assertLess(c.predict(0, 1.9), c.predict(256, 0.0))   # what the model alone says
    c.update_from_counts(counts, tokens)
    self.assertEqual(c.key, (("mosaic_gpu",), (256,)))
    c = layer_choice.LayerChoice(1, h, column_floor=False)
    c.update_from_counts(counts, tokens)
    self.assertEqual(c.key, (("mosaic_gpu",), (0,)))
    spread = np.zeros((1, h), np.int64)
    spread[0, :2000] = tokens // 1000  # no long column: K = 0 is cheapest and allowed
    self.assertEqual(features.column_floor(spread[0], tokens), 0)
    c = layer_choice.LayerChoice(1, h)
    c.update_from_counts(spread, tokens)
    self.assertEqual(c.hot, [0])


class HeavyRowsTest(absltest.TestCase):

  def test_rows_over_the_ell_width_weigh_in(self):
    """60 active per token, most on 400 features: 512 hot features are predicted cheapest.
    A tenth of the rows over the ELL width at K <= 512 (HEAVY_MARGIN times that is past the
    tail's R = M / 8): K = 768, where none are. A fifth over at every K, twice: the dense
    FFN."""
    tokens, h = 16384, 5632
    counts = np.zeros((1, h), np.int64)
    counts[0, :400] = tokens // 8
    counts[0, 400:2400] = tokens // 200
    c = layer_choice.LayerChoice(1, h)
    c.update_from_counts(counts, tokens)
    self.assertEqual(c.key, (("mosaic_gpu",), (512,)))
    heavy = np.zeros((1, 22))
    heavy[0, :3] = tokens // 10
    c.update_from_counts(counts, tokens, heavy)
    self.assertEqual(c.key, (("mosaic_gpu",), (768,)))
    # A few heavy rows fit the tail's smallest bucket at a small cost.
    few = np.zeros((1, 22))
    few[0, :4] = 8
    self.assertAlmostEqual(float(c.predict(768, c.tail[0], 8 / tokens))
                           - float(c.predict(768, c.tail[0])),
                           layer_choice.TAIL_ROW_COST * layer_choice.TAIL_BUCKETS[1])
    heavy[0, :] = tokens // 5
    c.update_from_counts(counts, tokens, heavy)
    self.assertEqual(c.describe(), "S768")    # one decision over dense_above: not yet
    c.update_from_counts(counts, tokens, heavy)
    self.assertEqual(c.describe(), "D")


  def test_a_first_decision_over_dense_above_holds_the_layer_and_its_k(self):
    """A window of dense batches (a loss spike): the sparse layer keeps K = 512 at the first
    decision over dense_above (not the near-dense K its prediction prefers, a build slower
    than both) and goes dense at the second."""
    tokens, h = 16384, 5632
    settled = np.zeros((1, h), np.int64)
    settled[0, :400] = tokens // 8
    settled[0, 400:2400] = tokens // 200
    spike = np.zeros((1, h), np.int64)
    spike[0, :3000] = tokens // 4
    spike[0, 3000:] = tokens // 30
    c = layer_choice.LayerChoice(1, h)
    c.update_from_counts(settled, tokens)
    self.assertEqual(c.describe(), "S512")
    changed, _ = c.update_from_counts(spike, tokens)
    self.assertFalse(changed)
    self.assertEqual((c.describe(), c.over), ("S512", [True]))
    self.assertGreater(c.predicted[0], c.dense_above)
    c.update_from_counts(spike, tokens)
    self.assertEqual(c.describe(), "D")
    # Back to the settled counts before a second vote: sparse at its K, the vote cleared.
    c = layer_choice.LayerChoice(1, h)
    c.update_from_counts(settled, tokens)
    c.update_from_counts(spike, tokens)
    c.update_from_counts(settled, tokens)
    self.assertEqual((c.describe(), c.over), ("S512", [False]))


class StepBuildsTest(absltest.TestCase):

  def test_get_waits_for_a_requested_build_and_keeps_executables(self):
    gate, built = threading.Event(), []

    def build(key):
      gate.wait(10)
      built.append(key)
      return f"step{key}"

    steps = choice_steps.StepBuilds(build)
    try:
      steps.request(("a",))
      steps.request(("a",))                            # being built: not again
      threading.Timer(0.2, gate.set).start()
      self.assertEqual(steps.get(("a",)), "step('a',)")   # waits for the build
      self.assertEqual(steps.get(("b",)), "step('b',)")   # never requested: built here
      steps.request(("a",))                            # built before: nothing to do
      self.assertEqual(built, [("a",), ("b",)])
      self.assertEqual(set(steps.build_s), {("a",), ("b",)})
    finally:
      steps.close()

  def test_a_failed_build_raises_where_its_step_is_taken(self):
    def build(key):
      if key == ("bad",):
        raise RuntimeError("lowering failed")
      return key[0]

    steps = choice_steps.StepBuilds(build)
    try:
      steps.request(("bad",))
      with self.assertRaisesRegex(RuntimeError, "lowering failed"):
        steps.get(("bad",))
      self.assertEqual(steps.get(("good",)), "good")
    finally:
      steps.close()

  def test_a_build_past_its_wait_raises_and_does_not_hold_close(self):
    """`get` waits at most `timeout` s (then `BuildTimeout`, every thread's stack logged);
    `busy()` until that build ends; `close()` does not wait for it (the worker is a daemon
    thread, so a build that never ends does not hold the process either)."""
    gate = threading.Event()
    self.addCleanup(gate.set)
    steps = choice_steps.StepBuilds(lambda key: gate.wait(30) and key[0])
    steps.request(("slow",))
    with self.assertLogs(level="ERROR") as logs:
      with self.assertRaisesRegex(choice_steps.BuildTimeout, "not built after 0 s"):
        steps.get(("slow",), timeout=0.2)
    self.assertIn("step-builds", logs.output[0])          # the worker thread's stack
    self.assertTrue(steps.busy())
    t0 = time.perf_counter()
    steps.close()
    self.assertLess(time.perf_counter() - t0, 1.0)
    gate.set()
    steps._worker.join(5)  # pylint: disable=protected-access
    self.assertFalse(steps.busy())
    self.assertEqual(steps.get(("slow",)), "slow")

  def test_child_processes_names_each_child_and_its_state(self):
    """What the timeout log says of a build's subprocesses (an exited ptxas shows as "Z")."""
    import subprocess  # pylint: disable=g-import-not-at-top
    running = subprocess.Popen(["sleep", "30"])
    exited = subprocess.Popen(["true"])
    self.addCleanup(running.wait)
    self.addCleanup(running.kill)
    children = choice_steps._child_processes  # pylint: disable=protected-access
    # Both settle within a moment: a child just started reads "R" until it sleeps.
    settled = lambda c: f"sleep {running.pid} S" in c and f"true {exited.pid} Z" in c
    deadline = time.time() + 5
    while not settled(children()) and time.time() < deadline:
      time.sleep(0.05)
    children = children()
    self.assertIn(f"sleep {running.pid} S", children)
    self.assertIn(f"true {exited.pid} Z", children)
    exited.wait()

  def test_foreground_builds_in_request(self):
    built = []
    steps = choice_steps.StepBuilds(lambda key: built.append(key) or key[0], background=False)
    steps.request(("b",))
    self.assertEqual(built, [("b",)])
    self.assertEqual(steps.get(("b",)), "b")
    steps.close()

  def test_a_switch_is_built_only_when_it_pays_for_its_build(self):
    no_payback = choice_steps.payback  # pylint: disable=protected-access
    h, tokens = 1024, 4096
    choice = layer_choice.LayerChoice(2, h)
    counts = np.zeros((2, h))
    counts[:, :8] = tokens // 8                  # 1 active feature per token, all hot-ish
    dense_key = choice.key
    choice.update_from_counts(counts, tokens)
    self.assertEqual(choice.implementations, ("mosaic_gpu",) * 2)
    saves = lambda left: no_payback(choice, dense_key, counts, None, tokens, left, 0.5)
    # Both layers at 0.6 of the dense FFN (the 8 features are long columns: K = 256): 0.2
    # dense steps' time saved per step, against BUILD_COST_STEPS (20): in steps, whatever
    # the machine's speed.
    self.assertIsNone(saves(1000))
    self.assertIn(f"less than the {layer_choice.BUILD_COST_STEPS:.0f}", saves(50))

  def test_a_layer_held_at_an_infinite_prediction_saves_nothing(self):
    """A layer predicted infinitely slow in the running step and in the choice (held there for
    one decision) gives no saving, not inf - inf: the other layers' change decides."""
    running = (("mosaic_gpu", "dense"), (256, 0))
    class Choice:
      key = (("mosaic_gpu", "mosaic_gpu"), (256, 256))
      def costs(self, key, counts, tokens, heavy):
        del counts, tokens, heavy
        return np.array([np.inf, 1.0 if key[0][1] == "dense" else 0.5])
    why = choice_steps.payback(Choice(), running, None, None, 1, 1000, 0.5)
    self.assertIsNone(why)                       # 0.5 * 0.25 * 1000 = 125 dense steps
    why = choice_steps.payback(Choice(), running, None, None, 1, 100, 0.5)
    self.assertIn("predicted to save 12.5 dense steps", why)

  def test_the_kernels_are_compiled_ahead_while_every_layer_runs_dense(self):
    """A run whose steps have no sparse layer builds, when it starts, a step with the first
    layer dense and the others on the kernels (compiling them once for every later choice's
    step), counted as built `landing_steps` after the run's start; none when a sparse step
    runs or is pending, on the interpreter, without background builds, or for a sparse
    implementation without kernels. A resumed run whose checkpoint names that step's ready
    step builds it again, ready from the same step."""
    import types  # pylint: disable=import-outside-toplevel

    def asked(sparse="mosaic_gpu", running_sparse=False, pending=None, interpret=False,
              background=True, start=0, ready_step=None, spec="256"):
      choice = layer_choice.LayerChoice(3, 1024, sparse_implementation=sparse)
      steps = choice_steps.ChoiceSteps.__new__(choice_steps.ChoiceSteps)
      requested = []
      steps.choice, steps.pending, steps.lag, steps.ahead = choice, pending, 7, None
      steps.ahead_spec = spec
      steps.running = ((sparse,) * 3, (256,) * 3) if running_sparse else choice.key
      steps.builds = types.SimpleNamespace(background=background, request=requested.append)
      steps.tr = types.SimpleNamespace(model_cfg=types.SimpleNamespace(interpret=interpret))
      steps._compile_kernels_ahead(start, ready_step)  # pylint: disable=protected-access
      self.assertEqual(steps.ahead, (tuple(requested), steps.ahead[1]) if requested else None)
      return requested, steps.ahead and steps.ahead[1]

    ahead = (("dense", "mosaic_gpu", "mosaic_gpu"), (0, 256, 256))
    self.assertEqual(asked(), ([ahead], 7))
    self.assertEqual(asked(start=40), ([ahead], 47))
    # `layer_choice.ahead` names more: here also K = 512 with the last layer dense; K = 1024
    # holds every feature (the dense step) and is left out; "" names none.
    self.assertEqual(asked(spec="256, 512:last,1024"),
                     ([ahead, (("dense", "mosaic_gpu", "dense"), (0, 512, 0))], 7))
    self.assertEqual(asked(spec=""), ([], None))
    self.assertEqual(asked(running_sparse=True), ([], None))
    self.assertEqual(asked(running_sparse=True, start=40, ready_step=7), ([ahead], 7))
    pending = ((("dense", "mosaic_gpu", "dense"), (0, 512, 0)), 40)
    self.assertEqual(asked(pending=pending), ([], None))
    self.assertEqual(asked(interpret=True), ([], None))
    self.assertEqual(asked(background=False), ([], None))
    self.assertEqual(asked(sparse="xla"), ([], None))

  def test_the_step_compiled_ahead_bridges_when_predicted_faster_than_the_running_one(self):
    """`_bridge` (`layer_choice.bridge`): the step compiled ahead runs while a choice builds
    once it counts as built and is predicted `BRIDGE_GAIN` faster than the running step, on
    this decision's counts: from the dense step, and from a first choice made at higher
    activity (K = 2560). Off (the default), never."""
    tokens, h = 16384, 5632
    counts = np.zeros((3, h), np.int64)
    counts[:, :200] = tokens // 10
    counts[:, 200:1200] = tokens // 400
    ahead = (("dense", "mosaic_gpu", "mosaic_gpu"), (0, 256, 256))

    def bridge(running, done=20, ready=10, on=True, counts=counts, variants=(ahead,),
               heavy=None, built=None):
      """`built`: the steps whose builds are done, counted as built by default (else
      `ready`, the step `layer_choice.wait_for_builds` counts them as built from)."""
      import types  # pylint: disable=import-outside-toplevel
      steps = choice_steps.ChoiceSteps.__new__(choice_steps.ChoiceSteps)
      steps.choice = layer_choice.LayerChoice(3, h)
      steps.choice.current, steps.choice.hot = ["mosaic_gpu"] * 3, [512] * 3
      steps.ahead, steps.running, steps.bridge = (variants, ready), running, on
      steps.wait_for_builds = built is None
      steps.builds = types.SimpleNamespace(done=lambda key: key in (built or ()))
      found = steps._bridge(done, counts, heavy, tokens)  # pylint: disable=protected-access
      return None if found is None else found[0]

    dense = (("dense",) * 3, (0,) * 3)
    self.assertEqual(bridge(dense), ahead)
    self.assertIsNone(bridge(dense, on=False))
    self.assertEqual(bridge((("dense", "mosaic_gpu", "mosaic_gpu"), (0, 2560, 2560))), ahead)
    self.assertIsNone(bridge(dense, done=9))    # not built by then
    # By default the step compiled ahead counts as built once its build is done, whatever
    # the step.
    self.assertEqual(bridge(dense, done=9, built=(ahead,)), ahead)
    self.assertIsNone(bridge(dense, done=20, built=()))
    self.assertIsNone(bridge(ahead))            # it runs already
    # The running step as fast, up to BRIDGE_GAIN: stays.
    self.assertIsNone(bridge((("dense", "mosaic_gpu", "mosaic_gpu"), (0, 512, 512))))
    # From the dense step at an activity where K = 256 is slower: the log says by how much.
    with self.assertLogs(logger="absl", level="INFO") as logs:
      self.assertIsNone(bridge(dense, counts=np.full((3, h), tokens // 8, np.int64)))
    self.assertRegex(logs.output[-1], r"step 20: the steps built ahead, predicted against "
                     r"1\.00 1\.00 1\.00 running, not run: D S256 S256: 1\.00 \d+\.\d\d "
                     r"\d+\.\d\d$")
    # The last layer still busy: of the two steps built ahead, the one with it dense runs.
    busy_last = counts.copy()
    busy_last[2] = tokens // 8
    last_dense = (("dense", "mosaic_gpu", "dense"), (0, 256, 0))
    self.assertIsNone(bridge(dense, counts=busy_last))
    self.assertEqual(bridge(dense, counts=busy_last, variants=(ahead, last_dense)), last_dense)
    self.assertEqual(bridge(dense, variants=(ahead, last_dense)), ahead)
    # A window of heavy rows in the running step's last layer (5% of the rows at every K:
    # past the tail's capacity at the margin a K is chosen by, inf there) is judged at its
    # expected time, here still faster than either step built ahead: it keeps running.
    spike = np.zeros((3, h // 256))
    spike[2] = 0.05 * tokens
    sparse_512 = (("dense", "mosaic_gpu", "mosaic_gpu"), (0, 512, 512))
    self.assertTrue(np.isinf(layer_choice.LayerChoice(3, h).costs(
        sparse_512, counts, tokens, spike)[2]))
    self.assertLess(layer_choice.LayerChoice(3, h).costs(
        sparse_512, counts, tokens, spike, expected=True)[2], 1.0)
    self.assertIsNone(bridge(sparse_512, heavy=spike, variants=(ahead, last_dense)))
    # Neither runs: the log gives each one's prediction.
    with self.assertLogs(logger="absl", level="INFO") as logs:
      self.assertIsNone(bridge(dense, counts=np.full((3, h), tokens // 8, np.int64),
                               variants=(ahead, last_dense)))
    self.assertRegex(logs.output[-1], r"not run: D S256 S256: [^;]+; D S256 D: 1\.00 "
                     r"\d+\.\d\d 1\.00$")

  def test_a_checkpoint_keeps_the_votes_for_dense(self):
    """A sparse layer predicted over dense_above at the last decision goes dense at the next
    one in a resumed run too: the checkpoint's metadata keeps the vote."""
    def steps_of(choice):
      steps = choice_steps.ChoiceSteps.__new__(choice_steps.ChoiceSteps)
      steps.choice, steps.pending, steps.counted, steps.counted_steps = choice, None, None, 0
      steps.running, steps.ahead = choice.key, None
      return steps

    before = layer_choice.LayerChoice(3, 1024, sparse_implementation="xla")
    before.update([0.5, 0.5, 0.5])
    before.update([1.2, 0.5, 1.2])
    self.assertEqual(before.over, [True, False, True])
    meta = json.loads(json.dumps(steps_of(before).meta()))
    after = steps_of(layer_choice.LayerChoice(3, 1024, sparse_implementation="xla"))
    after._restore(meta)  # pylint: disable=protected-access
    self.assertEqual(after.choice.over, [True, False, True])
    self.assertTrue(after.choice.update([1.2, 0.5, 1.2]))
    self.assertEqual(after.choice.describe(), "D S D")

  def test_ffn_share_of_the_paper_shape(self):
    share = layer_choice.ffn_flop_share(2048, 5632, 8, 32000, 2048, 32, 32)
    self.assertAlmostEqual(share, 0.54, delta=0.01)


class TrainerSwitchTest(tu.FastCompile, absltest.TestCase):

  def _rows(self, wd):
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      return [r for r in map(json.loads, f) if "sparse_layers" in r]

  def test_layers_switch_to_sparse_and_resume_with_the_choice(self):
    wd = self.create_tempdir().full_path
    # Every layer fires on far fewer than 1e9 features per token: all switch at the first
    # decision (after step 1); the foreground build lands the switch on that step. (From
    # initialisation every feature of the micro model fires on about half of the tokens, so
    # all would be hot, which makes a layer dense; without hot features here, the test is of
    # the switch itself.)
    self.enter_context(absltest.mock.patch.object(
        layer_choice.features_lib, "hot_feature_count", lambda *a, **k: 0))
    self.enter_context(absltest.mock.patch.object(
        layer_choice.LayerChoice, "_heavy", lambda *a: 0.0))
    self.enter_context(absltest.mock.patch.object(layer_choice, "BUILD_COST_STEPS", -1e9))
    cfg = tu.micro_config(num_train_steps=4, log_every=1, checkpoint_every=2,
                          **{"layer_choice.sparse": "xla", "layer_choice.sparse_below": 1e9,
                             "layer_choice.dense_above": 1e9,
                             "layer_choice.background": False})
    with self.assertLogs(level="INFO") as logs:
      train_lib.train_and_evaluate(cfg, wd)
    n = cfg.model.n_layers
    self.assertEqual([r["sparse_layers"] for r in self._rows(wd)], [0, n, n, n])
    self.assertTrue(any("ffn " + " ".join(["S"] * n) in line for line in logs.output)
                    or any("ffn S" in line for line in logs.output))
    self.assertIn("hot_features/layer_0", self._rows(wd)[-1])
    # The first step's wall-clock names the decision after it.
    self.assertLen([line for line in logs.output
                    if re.search(r"step 1's wall-clock: data .* on the device [\d.]+ s, "
                                 r"decision [\d.]+ s$", line)], 1)
    # Resumed: the checkpoint's choice runs from the first step on.
    cfg.num_train_steps = 5
    train_lib.train_and_evaluate(cfg, wd, accept_config_change=True)
    self.assertEqual(self._rows(wd)[-1]["sparse_layers"], n)

  def _decisions(self, lines):
    """[(decision step, choice, landing step)] and {step: choice running} from log lines."""
    decided, running = [], {}
    for line in lines:
      m = re.search(r"step (\d+): FFN per layer -> ([SD0-9 ]+?) \(predicted [^)]*\), "
                    r"running from step (\d+)", line)
      if m:
        decided.append((int(m.group(1)), m.group(2), int(m.group(3))))
      m = re.search(r"step (\d+)/\d+ .*\| ffn ([SD0-9 ]+)$", line)
      if m:
        running[int(m.group(1))] = m.group(2).strip()
    return decided, running

  def _micro_sparse_model(self):
    """A cost model that goes sparse at micro scale as L1 brings activity down (the micro
    model starts with half its features active), every build paying."""
    self.enter_context(absltest.mock.patch.object(
        layer_choice.LayerChoice, "predict",
        lambda self, hot, tail, heavy=0.0, expected=False:
        np.asarray(0.2 + 8 * np.asarray(tail) / self.d_ff)))
    self.enter_context(absltest.mock.patch.object(layer_choice, "BUILD_COST_STEPS", -1e9))

  def _ahead_config(self, **overrides):
    """`_micro_sparse_model`, with the portable sparse FFN standing in for the kernels in the
    steps compiled ahead (on the CPU nothing is compiled ahead), and the micro config these
    tests train, each choice landing on the step its decision names
    (`layer_choice.wait_for_builds`): `overrides` are its fields ("layer_choice.every" and the
    like)."""
    self._micro_sparse_model()
    self.enter_context(absltest.mock.patch.object(choice_steps.ChoiceSteps, "AHEAD_FOR",
                                                  ("xla",)))
    fields = {"num_train_steps": 18, "log_every": 1, "checkpoint_every": 0, "l1_coeff": 3e-2,
              "learning_rate": 3e-3, "model.d_ff": 1024, "layer_choice.sparse": "xla",
              "layer_choice.every": 2, "layer_choice.wait_for_builds": True, **overrides}
    return tu.micro_config(**fields)

  def _runs_with_slower_builds(self, cfg, delay: float):
    """The log lines of two runs of `cfg`, the second's builds `delay` seconds slower."""
    compile_step = trainer_lib.Trainer.compile_train_step
    out = []
    for d in (0.0, delay):
      def slow(self, *a, d=d, **k):
        time.sleep(d)
        return compile_step(self, *a, **k)
      with absltest.mock.patch.object(trainer_lib.Trainer, "compile_train_step", slow):
        with self.assertLogs(level="INFO") as logs:
          train_lib.train_and_evaluate(cfg, self.create_tempdir().full_path)
      out.append(logs)
    return out

  def test_same_seed_same_decisions_landing_on_their_steps(self):
    """With `layer_choice.wait_for_builds`, two runs of one seed make the same decisions on
    the same steps, and each choice runs from the step its decision names (decision step +
    `choice_steps.landing_lag`), however long its build takes: the second run's builds are
    slowed down, the steps the choices land on are not.
    No decision is superseded: none is made while another is pending.
    The micro model starts with half its features active (dense); L1 brings activity down
    and the layers switch (a cost model that goes sparse at micro scale)."""
    self._micro_sparse_model()
    cfg = tu.micro_config(num_train_steps=22, log_every=1, checkpoint_every=0, l1_coeff=3e-2,
                          learning_rate=3e-3,
                          **{"model.d_ff": 1024, "layer_choice.sparse": "xla",
                             "layer_choice.every": 2, "layer_choice.landing_steps": 7,
                             "layer_choice.wait_for_builds": True})
    runs = [self._decisions(logs.output) for logs in self._runs_with_slower_builds(cfg, 1.5)]
    (decided, running), (decided2, running2) = runs
    self.assertEqual(decided, decided2)
    self.assertEqual(running, running2)
    self.assertNotEmpty(decided)
    self.assertEqual(running[1], "D D")
    for (step, choice, first), later in zip(decided, decided[1:] + [None]):
      self.assertGreaterEqual(first, step + 7 + 1)   # 7 dense steps' time, or more steps
      if first in running:
        self.assertEqual(running[first], choice)     # every decision lands: step `first` ran it
      if later is not None:                          # none decided while one is pending
        self.assertGreaterEqual(later[0], first)
    self.assertIn("S", running[max(running)])

  def test_a_late_build_lands_once_built_and_the_loop_never_waits(self):
    """By default a choice whose build is not done by the step its decision names lands on
    the first step after that its build is done by: the loop never waits for it (each build
    is slowed down 0.4 s here, each step to 20 ms as on a GPU, so a build takes far longer
    than the 2 steps' lag), and every decided choice still runs."""
    self._micro_sparse_model()
    compile_step = trainer_lib.Trainer.compile_train_step
    step_for = choice_steps.ChoiceSteps.step_for

    def slow(self, key, *a, **k):
      if any(name != "dense" for name in key[0]):
        time.sleep(0.4)
      return compile_step(self, key, *a, **k)

    def gpu_paced(self, step):
      time.sleep(0.02)
      return step_for(self, step)
    self.enter_context(absltest.mock.patch.object(trainer_lib.Trainer, "compile_train_step",
                                                  slow))
    self.enter_context(absltest.mock.patch.object(choice_steps.ChoiceSteps, "step_for",
                                                  gpu_paced))
    cfg = tu.micro_config(num_train_steps=80, log_every=1, checkpoint_every=0, l1_coeff=3e-2,
                          learning_rate=3e-3,
                          **{"model.d_ff": 1024, "layer_choice.sparse": "xla",
                             "layer_choice.every": 2, "layer_choice.landing_steps": 2})
    workdir = self.create_tempdir().full_path
    with self.assertLogs(level="INFO") as logs:
      train_lib.train_and_evaluate(cfg, workdir)
    decided, running = self._decisions(logs.output)
    rows = metrics.read_jsonl(workdir)
    landed = [e for e in metrics.events(rows, "ffn_landing") if e["note"] == ""]
    self.assertNotEmpty(decided)
    self.assertGreaterEqual(len(landed), len(decided) - 1)   # the last may still be building
    for (step, choice, first), event in zip(decided, landed):
      self.assertEqual(event["choice"], choice)
      self.assertLess(event["waited_s"], 0.2)                 # no 0.4 s wait
      self.assertEqual(event["step"], first + event["late_steps"])
      self.assertEqual(running[event["step"]], choice)
    self.assertGreater(landed[0]["late_steps"], 0)            # 0.4 s: more than 2 steps
    self.assertTrue(any("steps after its step, once built" in l for l in logs.output))

  def test_choices_run_once_built_and_evaluations_on_them_agree_with_dense(self):
    """By default a choice whose build is done before the step its decision names (a lag of
    40 steps of 20 ms here, a build of well under a second) runs from the first step after
    its build, and held-out evaluations use the running sparse choice's FFNs once their step
    is compiled (beside training, from `EVAL_LEAD_STEPS` before the evaluation), the dense
    FFNs before: each sparse evaluation's loss and activity equal the dense FFNs' on the same
    parameters. With `wait_for_builds` a choice lands on its step and every evaluation stays
    dense."""
    self._micro_sparse_model()
    step_for = choice_steps.ChoiceSteps.step_for
    evaluate = trainer_lib.Trainer.evaluate
    pairs = []

    def gpu_paced(self, step):
      time.sleep(0.02)
      return step_for(self, step)

    def evaluate_both(self, params, batches, layer_key=None):
      ev = evaluate(self, params, batches, layer_key)
      if layer_key is not None and any(n != "dense" for n in layer_key[0]):
        pairs.append((ev, evaluate(self, params, batches, (("dense",) * len(layer_key[0]),
                                                           (0,) * len(layer_key[0])))))
      return ev
    self.enter_context(absltest.mock.patch.object(choice_steps.ChoiceSteps, "step_for",
                                                  gpu_paced))
    self.enter_context(absltest.mock.patch.object(trainer_lib.Trainer, "evaluate",
                                                  evaluate_both))
    self.enter_context(absltest.mock.patch.object(choice_steps.ChoiceSteps,
                                                  "EVAL_LEAD_STEPS", 30))
    late, evals = {}, {}
    for wait in (False, True):
      cfg = tu.micro_config(num_train_steps=120, log_every=1, checkpoint_every=0,
                            l1_coeff=3e-2, learning_rate=3e-3, eval_every=30, eval_batches=2,
                            **{"model.d_ff": 1024, "layer_choice.sparse": "xla",
                               "layer_choice.every": 2, "layer_choice.landing_steps": 40,
                               "layer_choice.wait_for_builds": wait})
      workdir = self.create_tempdir().full_path
      with self.assertLogs(level="INFO") as logs:
        train_lib.train_and_evaluate(cfg, workdir)
      decided, running = self._decisions(logs.output)
      landed = [e for e in metrics.events(metrics.read_jsonl(workdir), "ffn_landing")
                if e["note"] == ""]
      self.assertNotEmpty(landed)
      for (_, choice, first), event in zip(decided, landed):
        self.assertEqual(event["choice"], choice)
        self.assertEqual(event["step"], first + event["late_steps"])
        self.assertEqual(running[event["step"]], choice)
      late[wait] = [e["late_steps"] for e in landed]
      self.assertEqual(any("steps before its step, once built" in l for l in logs.output),
                       not wait)
      evals[wait] = [re.search(r"eval step (\d+) \(FFN per layer ([SD0-9 ]+)\)", line)
                     for line in logs.output if "eval step" in line]
      self.assertLen(evals[wait], 4)
      self.assertTrue(all(evals[wait]))
    self.assertLess(min(late[False]), 0)
    self.assertEqual(set(late[True]), {0})
    self.assertEqual({m.group(2) for m in evals[True]}, {"D D"})
    sparse = [m for m in evals[False] if "S" in m.group(2)]
    self.assertNotEmpty(sparse)
    self.assertLen(pairs, len(sparse))
    for ev, dense in pairs:
      self.assertAlmostEqual(ev["loss"], dense["loss"], delta=1e-4 * dense["loss"])
      np.testing.assert_allclose(ev["active_per_token"], dense["active_per_token"], rtol=1e-3)
      self.assertEqual(ev["never_fired_fraction"], dense["never_fired_fraction"])

  def test_the_steps_compiled_ahead_do_not_stand_in_for_a_choice_building(self):
    """With `layer_choice.bridge` off, while every layer runs dense and a choice builds, the
    steps compiled ahead (`layer_choice.ahead="256,512"`: first layer dense, the others at
    K = 256, and at 512) do not run in its place; the choices land on the same steps when
    builds are slow, with `layer_choice.landing_by_layers` after their share of sparse layers
    of `landing_steps` (a quarter at least)."""
    cfg = self._ahead_config(**{"layer_choice.landing_steps": 7, "layer_choice.bridge": False,
                                "layer_choice.ahead": "256,512",
                                "layer_choice.landing_by_layers": True})
    runs = [(self._decisions(logs.output), logs.output)
            for logs in self._runs_with_slower_builds(cfg, 1.0)]
    ((decided, running), output), (second, _) = runs
    self.assertEqual((decided, running), second)
    self.assertTrue(any("building the step of D S256 and of D S512" in l for l in output))
    step, choice, land = decided[0]
    self.assertEqual(land - step - 1, math.ceil(7 * max(choice.count("S") / 2, 0.25)))
    self.assertEqual({running[s] for s in range(1, land)}, {"D D"})
    self.assertEqual(running[land], choice)

  def test_with_bridge_the_step_compiled_ahead_runs_alike_in_every_run_and_after_resume(self):
    """`layer_choice.bridge`: while every layer runs dense, the step compiled ahead runs from
    the step after a choice is decided, once it counts as built (`landing_steps` after the
    start) and is predicted faster, until that choice lands: on the same steps when builds
    are slow, and in a run resumed between the two."""
    cfg = self._ahead_config(checkpoint_every=2, keep_checkpoints=9, **{
        "layer_choice.landing_steps": 5, "layer_choice.bridge": True})
    unsaved = cfg.copy_and_resolve_references()
    unsaved.checkpoint_every = 0    # checkpoints only for the resume below
    runs = [(self._decisions(logs.output), [l for l in logs.output if "compiled ahead" in l])
            for logs in self._runs_with_slower_builds(unsaved, 1.0)]
    ((decided, running), bridged), second = runs
    self.assertEqual((decided, running), second[0])
    step, choice, land = decided[0]
    self.assertGreaterEqual(step, 1 + 5)          # the step compiled ahead counts as built
    self.assertLen(bridged, 1)
    self.assertIn(f"step {step + 1}: now running FFN per layer D S256", bridged[0])
    self.assertEqual([running[s] for s in range(1, step + 1)], ["D D"] * step)
    self.assertEqual({running[s] for s in range(step + 1, land)}, {"D S256"})
    self.assertEqual(running[land], choice)
    # Killed while the bridge runs (checkpoints after it lost), resumed: the same state.
    lost = tuple(s for s in range(2, 19, 2) if s > step + 2)
    logs, _ = self._resume_after_losing(cfg, lost, 18)
    self.assertTrue(any(f"Resumed from checkpoint step {step + 2}" in l for l in logs))
    self.assertEqual(self._decisions(logs)[1][step + 3], "D S256")
  def test_a_failed_build_of_the_step_compiled_ahead_leaves_training_going(self):
    """The step compiled ahead fails to build: the worker logs it and training goes on with
    the running step; the decided choice still lands."""
    cfg = self._ahead_config(**{"layer_choice.landing_steps": 7})
    compile_step = trainer_lib.Trainer.compile_train_step

    def failing(self, key, *a, **k):
      if key == (("dense", "xla"), (0, 256)):
        raise RuntimeError("out of host memory")
      return compile_step(self, key, *a, **k)
    self.enter_context(absltest.mock.patch.object(trainer_lib.Trainer, "compile_train_step",
                                                  failing))
    with self.assertLogs(level="INFO") as logs:
      train_lib.train_and_evaluate(cfg, self.create_tempdir().full_path)
    self.assertTrue(any("(RuntimeError: out of host memory)" in l for l in logs.output))
    decided, running = self._decisions(logs.output)
    self.assertEqual(running[decided[0][2]], decided[0][1])
    self.assertEqual(running[decided[0][0] + 1], "D D")

  def test_a_build_that_does_not_come_back_leaves_training_going(self):
    """The first choice's build never ends: once it is `layer_choice.build_timeout_s` late
    for its landing, the loop logs it and trains on with the running step; no choice is
    decided while that build holds the worker; the run ends."""
    self._micro_sparse_model()
    gate = threading.Event()

    def release():   # the build ends before the interpreter does
      gate.set()
      for t in threading.enumerate():
        if t.name == "step-builds":
          t.join(60)
    self.addCleanup(release)
    compile_step = trainer_lib.Trainer.compile_train_step

    def stuck(self, key, *a, **k):
      if any(name != "dense" for name in key[0]):
        gate.wait(120)
      return compile_step(self, key, *a, **k)
    self.enter_context(absltest.mock.patch.object(trainer_lib.Trainer, "compile_train_step",
                                                  stuck))
    # Waiting for builds, the loop waits 0.5 s at the landing and gives up on it; by default
    # it trains on meanwhile, as long as the build is less than 0.5 s late.
    for wait in (True, False):
      cfg = tu.micro_config(num_train_steps=18, log_every=1, checkpoint_every=0,
                            l1_coeff=3e-2, learning_rate=3e-3,
                            **{"model.d_ff": 1024, "layer_choice.sparse": "xla",
                               "layer_choice.every": 2, "layer_choice.landing_steps": 3,
                               "layer_choice.build_timeout_s": 0.5,
                               "layer_choice.wait_for_builds": wait})
      with self.subTest(wait_for_builds=wait), self.assertLogs(level="INFO") as logs:
        train_lib.train_and_evaluate(cfg, self.create_tempdir().full_path)
        decided, running = self._decisions(logs.output)
        self.assertLen(decided, 1)                           # none while the build is stuck
        if wait:
          self.assertTrue(any("BuildTimeout: not built after 0 s" in l for l in logs.output))
        self.assertEqual(set(running.values()), {"D D"})
        self.assertEqual(max(running), 18)

  def test_landing_lag_is_dense_steps_time_at_the_running_choices_predicted_speed(self):
    """A decision taken while dense layers run lands `landing_steps` steps later; while
    sparse layers predicted at 0.33 of the dense FFN's time run (a step at 1 - 0.5 x 0.67 of
    a dense step's), ceil(200 / 0.665) = 301 steps later: the same seconds for the build."""
    choice = layer_choice.LayerChoice(2, 1024)
    counts = np.zeros((2, 1024), np.int64)
    lag = lambda key, n=200: choice_steps.landing_lag(choice, key, counts, None, 4096, n, 0.5)
    self.assertEqual(lag((("dense", "dense"), (0, 0))), 200)
    self.assertEqual(lag((("mosaic_gpu", "mosaic_gpu"), (0, 0))), 301)
    self.assertEqual(lag((("dense", "mosaic_gpu"), (0, 0))), math.ceil(200 / (1 - 0.5 * 0.335)))
    self.assertEqual(lag((("mosaic_gpu", "mosaic_gpu"), (0, 0)), 0), 0)
    # `landing_by_layers`: the new choice's share of sparse layers (here one of two, then a
    # quarter at least), at the same running speed.
    by = lambda n_sparse, layers=2: choice_steps.landing_lag(
        layer_choice.LayerChoice(layers, 1024, current=["mosaic_gpu"] * n_sparse
                                 + ["dense"] * (layers - n_sparse)),
        (("dense",) * layers, (0,) * layers), np.zeros((layers, 1024), np.int64), None, 4096,
        200, 0.5, by_layers=True)
    self.assertEqual([by(0), by(1), by(2)], [50, 100, 200])
    self.assertEqual([by(1, 8), by(4, 8), by(7, 8)], [50, 100, 175])

  def _resume_after_losing(self, cfg, lost_steps, last_step):
    """Trains `cfg` twice, deletes `lost_steps`' checkpoints from the second run (as if killed
    before them), resumes it; asserts its state at `last_step` is the first run's, bit for bit.
    Returns the resumed run's log lines and its workdir."""
    import shutil  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    from train.state import checkpointing  # pylint: disable=g-import-not-at-top
    ref, run = self.create_tempdir().full_path, self.create_tempdir().full_path
    train_lib.train_and_evaluate(cfg, ref)
    train_lib.train_and_evaluate(cfg, run)
    for step in lost_steps:
      shutil.rmtree(os.path.join(checkpointing.checkpoint_dir(run), str(step)))
    with self.assertLogs(level="INFO") as logs:
      train_lib.train_and_evaluate(cfg, run)
    tr = trainer_lib.Trainer(cfg)
    states = []
    for wd in (ref, run):
      mngr = checkpointing.make_manager(wd, read_only=True)
      states.append(jax.device_get(mngr.restore(last_step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(tr.abstract_state()))).state))
      mngr.close()
    self.assertTrue(tu.tree_equal(*states))
    return logs.output, run

  def _always_sparse(self):
    # Half of the micro model's features fire (from initialisation): every row is over the
    # ELL width, which would keep the layers dense; these tests are of the steps alone.
    self.enter_context(absltest.mock.patch.object(
        layer_choice.LayerChoice, "_heavy", lambda *a: 0.0))
    self.enter_context(absltest.mock.patch.object(layer_choice, "BUILD_COST_STEPS", -1e9))

  def test_a_pending_choice_lands_on_its_step_after_a_resume(self):
    """Killed after a decision and before its choice lands: the resumed run lands it on the
    same step (the checkpoint keeps it) and ends with the uninterrupted run's state."""
    self.enter_context(absltest.mock.patch.object(
        layer_choice.features_lib, "hot_feature_count", lambda *a, **k: 0))
    self._always_sparse()
    # Decided after step 1 (sparse everywhere), running from step 1 + 3 + 1 = 5; killed after
    # the checkpoint of step 4.
    cfg = tu.micro_config(num_train_steps=8, checkpoint_every=2, keep_checkpoints=5,
                          **{"layer_choice.sparse": "xla", "layer_choice.every": 2,
                             "layer_choice.sparse_below": 1e9, "layer_choice.dense_above": 1e9,
                             "layer_choice.landing_steps": 3,
                             "layer_choice.wait_for_builds": True})
    logs, workdir = self._resume_after_losing(cfg, (6, 8), 8)
    self.assertTrue(any("Resumed from checkpoint step 4" in line for line in logs))
    self.assertTrue(any("step 5: now running FFN per layer S S" in line for line in logs))
    # The decision and the landing are events in metrics.jsonl (what benchmarks.whole_run
    # reads): decided after step 1, landed on step 5 by the resumed run, with its wait.
    rows = metrics.read_jsonl(workdir)
    self.assertIn([1, "S S", 5], [[e["step"], e["choice"], e["runs_from"]]
                                  for e in metrics.events(rows, "ffn_decision")])
    landed = [e for e in metrics.events(rows, "ffn_landing") if e["step"] == 5]
    self.assertNotEmpty(landed)
    self.assertEqual((landed[-1]["choice"], landed[-1]["waited_s"] >= 0), ("S S", True))

  def test_resumed_run_decides_and_sorts_on_the_same_steps(self):
    """A run resumed from step 2 ends with the uninterrupted run's state, bit for bit: its
    decisions (each sorts the features of the state) fall on the same steps. (A decision on
    the resumed run's first step sorted by that step's counts alone, and the two states then
    held the same model with its features in different orders.) The decision at step 4
    sorts by the counts of steps 2-4: the checkpoint of step 2 holds step 2's, which the
    resumed run adds to."""
    self._always_sparse()
    cfg = tu.micro_config(num_train_steps=6, checkpoint_every=2, keep_checkpoints=3,
                          **{"layer_choice.sparse": "xla", "layer_choice.every": 4,
                             "layer_choice.sparse_below": 1e9, "layer_choice.dense_above": 1e9,
                             "layer_choice.background": False})
    logs, _ = self._resume_after_losing(cfg, (4, 6), 6)
    self.assertTrue(any("Resumed from checkpoint step 2" in line for line in logs))

  def test_sorting_the_state_keeps_the_function_and_the_optimizer_matched(self):
    """Trainer.sort_features permutes each layer's hidden features in the parameters, the
    AdamW moments and the dead-feature counters alike: the loss and the next step's update
    are those of the unpermuted state (up to the order of sums)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    cfg = tu.micro_config()
    tr = trainer_lib.Trainer(cfg)
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

  def test_replay_is_the_trainers_decision_then_the_prefills(self):
    """`implementations.replay` (what the benchmarks report): one decision of the training
    choice on the counts, then the inference choice with the hot features it picked."""
    tokens, h = 16384, 5632
    counts = np.zeros((2, h), np.int64)
    counts[0, :2000] = tokens // 100        # layer 0: ~20 active per token, sparse
    counts[1, :] = tokens // 2              # layer 1: half of H per token, dense
    mc = model_lib.ModelConfig(vocab_size=256, d_model=2048, n_layers=2, n_heads=16,
                               n_kv_heads=16, d_ff=h)
    choice, order, infer = implementations.replay(mc, counts, tokens, sparse="xla")
    direct = layer_choice.LayerChoice(2, h, sparse_implementation="xla")
    _, direct_order = direct.update_from_counts(counts, tokens)
    self.assertEqual(choice.key, direct.key)
    self.assertEqual(choice.implementations, ("xla", "dense"))
    np.testing.assert_array_equal(order, direct_order)
    expected = layer_choice.LayerChoice.for_inference(direct.tail, h, direct.hot,
                                                      sparse_implementation="xla")
    self.assertEqual(infer.implementations, expected.implementations)
    strict, _, _ = implementations.replay(mc, counts, tokens, sparse="xla", sparse_below=0.0)
    self.assertEqual(strict.implementations, ("dense", "dense"))

  def test_no_choice_for_an_explicit_implementation_or_a_dense_auto(self):
    def choice(**overrides):
      cfg = tu.micro_config(**overrides)
      mc = model_lib.ModelConfig.from_config(cfg.model)
      return implementations.layer_choice(cfg, mc, n_devices=1)

    self.assertIsNone(choice(**{"model.ffn_implementation": "xla"}))
    self.assertIsNone(choice(**{"layer_choice.enabled": False}))
    self.assertIsNone(choice())   # auto resolves to dense on the CPU: nothing to choose
    self.assertIsNone(choice(**{"model.ffn_activation": "silu", "layer_choice.sparse": "xla"}))
    picked = choice(**{"layer_choice.sparse": "xla"})
    self.assertEqual(picked.sparse_implementation, "xla")
    self.assertEqual(picked.implementations, ("dense",) * picked.n_layers)



class SparseEvaluationGpuTest(absltest.TestCase):
  """On a Hopper GPU, the evaluation step of a sparse choice (the forward kernels, hot
  features in some layers) compiled ahead gives the dense FFNs' loss and activity on the same
  parameters: what `ChoiceSteps.eval_key` lets a training run evaluate on."""

  @pytest.mark.gpu
  def test_sparse_choice_evaluates_as_dense(self):
    import jax  # pylint: disable=import-outside-toplevel
    from pallas_kernels import _target as target  # pylint: disable=import-outside-toplevel
    if not target.on_hopper():
      self.skipTest("needs a Hopper GPU")
    cfg = tiny.get_config()   # the data is random tokens: nothing read
    cfg.update(batch_size=8)
    cfg.data.seq_len = 512
    cfg.model.update(d_model=256, n_heads=4, n_kv_heads=2, d_ff=1024, n_layers=3,
                     ffn_activation="relu", dtype="bfloat16")
    tr = trainer_lib.Trainer(cfg)
    params = tr.new_state(jax.random.key(0))["params"]
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.model.vocab_size, (8, cfg.data.seq_len + 1), np.int32)
               for _ in range(3)]
    dense = (("dense",) * 3, (0,) * 3)
    sparse = (("dense", "mosaic_gpu", "mosaic_gpu"), (0, 256, 0))
    tr.compile_eval_ahead(params, batches[0], sparse)
    ref = tr.evaluate(params, batches, dense)
    ev = tr.evaluate(params, batches, sparse)
    self.assertTrue(tr.eval_compiled(sparse))
    self.assertAlmostEqual(ev["loss"], ref["loss"], delta=2e-3 * ref["loss"])
    np.testing.assert_allclose(ev["active_per_token"], ref["active_per_token"], rtol=2e-2)

if __name__ == "__main__":
  absltest.main()
