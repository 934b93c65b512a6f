"""Tests for the training loop: metrics/TensorBoard output, resume, grad
accumulation and data parallelism over several (host) devices."""

import json
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import train_test_util as tu
from train.state import steps as steps_lib
from train.training import loop as train_lib
from train.state import trainer as trainer_lib
from train import errors

class TrainLoopTest(tu.FastCompile, absltest.TestCase):

  def test_train_logs_metrics_tensorboard_and_resumes(self):
    wd = self.create_tempdir().full_path
    cfg = tu.micro_config(num_train_steps=30, log_every=5, eval_every=15,
                          checkpoint_every=10, learning_rate=3e-3)
    last = train_lib.train_and_evaluate(cfg, wd)
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    train_rows = [r for r in rows if "loss" in r]
    self.assertEqual([r["step"] for r in train_rows], [1, 5, 10, 15, 20, 25,
                                                       30])
    for key in ("loss", "cross_entropy", "l1_term", "l1_coeff",
                "learning_rate", "grad_norm", "tokens_per_s",
                "active_per_token/layer_1", "max_tile_nnz/layer_0",
                "overflow_rows/layer_1", "dead_fraction/layer_0"):
      self.assertIn(key, train_rows[-1])
    self.assertEqual(last["loss"], train_rows[-1]["loss"])
    # Loss falls from ~ln(259) on the offline corpus.
    self.assertGreater(train_rows[0]["loss"], 5.0)
    self.assertLess(train_rows[-1]["loss"], train_rows[0]["loss"] - 1.0)
    self.assertTrue(any("eval/loss" in r for r in rows))

    from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
    acc = event_accumulator.EventAccumulator(os.path.join(wd, "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    self.assertIn("loss", tags)
    self.assertIn("eval/perplexity", tags)
    self.assertLen(acc.Scalars("loss"), 7)

    # Same workdir, more steps (a change of the run, accepted): resumes at 30 and continues.
    cfg.num_train_steps = 32
    with self.assertRaisesRegex(errors.ConfigError, "num_train_steps: 30 -> 32"):
      train_lib.train_and_evaluate(cfg, wd)
    cfg.profile.first_step, cfg.profile.steps = 30, 1   # a free change: traces step 31
    train_lib.train_and_evaluate(cfg, wd, accept_config_change=True)
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    steps = [r["step"] for r in rows if "loss" in r]
    self.assertEqual(steps[-2:], [31, 32])  # first step after resume, last
    import glob  # pylint: disable=g-import-not-at-top
    self.assertLen(glob.glob(os.path.join(wd, "profile", "**", "perfetto_trace.json.gz"),
                             recursive=True), 1)

  def test_a_fresh_run_makes_its_state_while_the_data_opens(self):
    """A fresh run's state is made on a worker thread, begun before the held-out batches are
    made (the data opens on the host meanwhile); the same state as on the main thread. A run
    that resumes makes none."""
    import threading  # pylint: disable=import-outside-toplevel
    from train.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
    seen, made = [], []
    new_state, eval_batches = trainer_lib.Trainer.new_state, data_lib.eval_batches

    def recorded_new_state(tr, key):
      seen.append(("state", threading.current_thread() is threading.main_thread()))
      state = new_state(tr, key)
      made.append(jax.device_get(state))   # the run donates the state's buffers
      return state

    def recorded_eval_batches(*args, **kwargs):
      out = eval_batches(*args, **kwargs)
      seen.append(("held-out batches", None))
      return out

    self.enter_context(absltest.mock.patch.object(trainer_lib.Trainer, "new_state",
                                                  recorded_new_state))
    self.enter_context(absltest.mock.patch.object(data_lib, "eval_batches",
                                                  recorded_eval_batches))
    wd = self.create_tempdir().full_path
    cfg = tu.micro_config(num_train_steps=2, eval_every=2, checkpoint_every=2)
    with self.assertLogs(logger="absl", level="INFO") as logs:
      train_lib.train_and_evaluate(cfg, wd)
    # Where the first step's wall-clock went, once (no per-layer choice on the CPU).
    clocks = [r.getMessage() for r in logs.records if "wall-clock:" in r.getMessage()]
    self.assertLen(clocks, 1)
    self.assertRegex(clocks[0], r"^step 1's wall-clock: data [\d.]+ s, dispatch [\d.]+ s, "
                                r"on the device [\d.]+ s$")
    self.assertEqual(seen[0], ("state", False))
    self.assertIn(("held-out batches", None), seen)
    same = new_state(trainer_lib.Trainer(cfg), jax.random.key(cfg.seed))
    jax.tree.map(np.testing.assert_array_equal, made[0], jax.device_get(same))
    seen.clear()
    cfg.num_train_steps = 3
    train_lib.train_and_evaluate(cfg, wd, accept_config_change=True)
    self.assertEqual(seen, [("held-out batches", None)])

  def test_making_the_trainer_runs_no_program(self):
    """Trainer(cfg) and abstract_state() compile no program but the optimizer's step-count
    scalar (`mesh.state_shardings` makes it on the CPU backend, which a CPU-only test cannot
    tell apart): on a GPU the process's first compile (the compiler's start-up) then happens
    on the run's worker threads, not on the main thread before the data opens. A fresh
    process: the jit cache of this one may hold them."""
    script = textwrap.dedent("""
        import logging, jax
        jax.config.update("jax_log_compiles", True)
        compiled = []
        class Seen(logging.Handler):
          def emit(self, record):
            if record.getMessage().startswith("Compiling "):
              compiled.append(record.getMessage().split(" with ")[0])
        logging.getLogger("jax").addHandler(Seen())
        import train_test_util as tu
        from train.state import trainer as trainer_lib
        tr = trainer_lib.Trainer(tu.micro_config())
        tr.abstract_state()
        print("COMPILED", compiled)
        """)
    out = tu.run([sys.executable, "-c", script],
                 PYTHONPATH=os.path.dirname(__file__) + os.pathsep + tu.REPO)
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertIn("COMPILED ['Compiling jit(convert_element_type)']", out.stdout)

  def test_grad_accumulation_matches_one_big_batch(self):
    outs = []
    tokens = np.random.default_rng(0).integers(3, 259, (8, 33)).astype(
        np.int32)
    for accum in (1, 2):
      cfg = tu.micro_config(grad_accum_steps=accum, l1_coeff=1e-3)
      tr = trainer_lib.Trainer(cfg)
      state = tr.init_state(jax.random.key(0))
      step = jax.jit(steps_lib.make_train_step(tr.lm, tr.tx, cfg))
      state, m = step(state, jnp.asarray(tokens.reshape(accum, 8 // accum,
                                                         33)))
      outs.append((state["params"], m))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=2e-5, atol=2e-6), outs[0][0], outs[1][0])
    np.testing.assert_allclose(outs[0][1]["loss"], outs[1][1]["loss"],
                               rtol=1e-5)

  def test_data_parallel_on_four_host_devices(self):
    # A fresh process: the device count is fixed when the backend starts.
    script = textwrap.dedent("""
        import jax, numpy as np
        jax.config.update("jax_disable_most_optimizations", True)
        import train_test_util as tu
        from train.training import loop as train_lib
        from train.state import trainer as trainer_lib
        from train import errors
        assert jax.device_count() == 4, jax.devices()
        cfg = tu.micro_config(batch_size=8)
        tokens = np.random.default_rng(0).integers(3, 259, (3, 1, 8, 33))
        params = []
        for devs in (jax.devices()[:1], jax.devices()):
          mesh = jax.sharding.Mesh(np.array(devs), ("data",))
          tr = trainer_lib.Trainer(cfg, mesh=mesh)
          state = jax.jit(tr.init_state, out_shardings=tr.replicated)(
              jax.random.key(0))
          step = tr.jit_train_step()
          for t in tokens:
            batch = tr.put_batch(t.astype(np.int32), tr.batch_sharding)
            assert len(batch.sharding.device_set) == len(devs)
            state, m = step(state, batch)
          params.append(jax.device_get(state["params"]))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            a, b, rtol=1e-4, atol=1e-6), *params)
        print("DP_OK", len(jax.devices()))
        """)
    out = tu.run([sys.executable, "-c", script],
                 XLA_FLAGS="--xla_force_host_platform_device_count=4",
                 PYTHONPATH=os.path.dirname(__file__) + os.pathsep + tu.REPO)
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertIn("DP_OK 4", out.stdout)


if __name__ == "__main__":
  absltest.main()
