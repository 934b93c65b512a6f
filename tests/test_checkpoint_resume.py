"""End-to-end checkpoint tests through the CLI (subprocesses, tiny config).

* SIGKILL mid-training, rerun the same command: the final parameters equal
  those of an uninterrupted run bit for bit (same machine, same program).
* A damaged latest checkpoint is moved aside and training resumes from the
  previous one (again ending bit-identical); if no checkpoint is usable the
  command fails with a one-line error and no traceback, and the next run does
  not start over from step 0 unless --allow_fresh_start says so.
* A rerun with a different model is refused before any checkpoint is touched;
  a change of the optimisation needs --accept_config_change; a checkpoint that
  does not fit the model is never quarantined.
* `python -m train.evaluate` prints JSON for the latest or a given step.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest

import train_test_util as tu

STEPS = 40
FLAGS = (f"--config.num_train_steps={STEPS}", "--config.checkpoint_every=10",
         "--config.keep_checkpoints=2", "--config.eval_every=0",
         "--config.log_every=10", "--config.l1_coeff=3e-4")


def _final_params(workdir):
  return tu.restore_params(workdir, STEPS)


_steps = tu.checkpoint_steps


def _corrupt(workdir, step):
  """Truncates every array data file of one step."""
  root = os.path.join(workdir, "checkpoints", str(step), "state")
  n = 0
  for dirpath, _, files in os.walk(root):
    if os.path.basename(dirpath) == "d":
      for f in files:
        with open(os.path.join(dirpath, f), "r+b") as fh:
          fh.truncate(7)
        n += 1
  assert n, f"no data files found under {root}"


class CheckpointResumeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root = tempfile.mkdtemp(prefix="twell_ckpt_test_")
    cls.ref = os.path.join(cls.root, "ref")
    out = tu.run(tu.main_cmd(cls.ref, *FLAGS))
    assert out.returncode == 0, out.stderr[-3000:]
    cls.ref_stderr = out.stderr
    cls.ref_params = _final_params(cls.ref)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.root, ignore_errors=True)
    super().tearDownClass()

  def _fresh(self, name, from_ref=False):
    path = os.path.join(self.root, name)
    shutil.rmtree(path, ignore_errors=True)
    if from_ref:
      shutil.copytree(self.ref, path)
    return path

  def test_sigkill_then_rerun_matches_uninterrupted_run(self):
    wd = self._fresh("killed")
    cmd = tu.main_cmd(wd, *FLAGS)
    proc = subprocess.Popen(cmd, cwd=tu.REPO, env=tu.run_env(),
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not _steps(wd) and time.time() < deadline and proc.poll() is None:
      time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    self.assertEqual(proc.returncode, -signal.SIGKILL,
                     "the run finished before it could be killed")
    killed_at = _steps(wd)
    self.assertNotEmpty(killed_at)
    self.assertLess(max(killed_at), STEPS)
    out = tu.run(cmd)
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertIn("Resumed from checkpoint step", out.stderr)
    # The uninterrupted run's first step was compiled while its data opened, the resumed
    # run's at its first step: the same program either way.
    self.assertIn("compiled the first train step", self.ref_stderr)
    self.assertNotIn("compiled the first train step", out.stderr)
    self.assertTrue(tu.tree_equal(_final_params(wd), self.ref_params),
                    "resumed run diverged from the uninterrupted run")

  def test_corrupt_latest_checkpoint_falls_back_to_previous(self):
    wd = self._fresh("corrupt_latest", from_ref=True)
    self.assertEqual(_steps(wd), [30, 40])
    _corrupt(wd, 40)
    out = tu.run(tu.main_cmd(wd, *FLAGS))
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertIn("Checkpoint step 40 is unreadable", out.stderr)
    self.assertIn("Resumed from checkpoint step 30", out.stderr)
    self.assertNotEmpty(os.listdir(os.path.join(wd, "corrupt_checkpoints")))
    self.assertTrue(tu.tree_equal(_final_params(wd), self.ref_params))

  def test_no_usable_checkpoint_is_a_clear_error_and_no_silent_restart(self):
    wd = self._fresh("corrupt_all", from_ref=True)
    for step in _steps(wd):
      _corrupt(wd, step)
    out = tu.run(tu.main_cmd(wd, *FLAGS))
    self.assertNotEqual(out.returncode, 0)
    self.assertIn("error: no usable checkpoint", out.stderr)
    self.assertNotIn("Traceback", out.stderr)
    # checkpoints/ is empty now: the next run must not quietly train from step 0.
    self.assertEqual(_steps(wd), [])
    out = tu.run(tu.main_cmd(wd, *FLAGS))
    self.assertNotEqual(out.returncode, 0)
    self.assertIn("not starting over from step 0 on its own", out.stderr)
    self.assertIn("--allow_fresh_start", out.stderr)
    self.assertNotIn("Traceback", out.stderr)
    out = tu.run(tu.main_cmd(wd, *FLAGS, "--allow_fresh_start"))
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertNotIn("Resumed from checkpoint", out.stderr)
    self.assertTrue(tu.tree_equal(_final_params(wd), self.ref_params))

  def test_config_changes_on_resume(self):
    """The issue's sequence: a model typo on a trained workdir, then the right config."""
    wd = self._fresh("config_change", from_ref=True)
    before = {n: sorted(os.listdir(os.path.join(wd, "checkpoints", n))) for n in ("30", "40")}
    out = tu.run(tu.main_cmd(wd, *FLAGS, "--config.model.d_model=128"))
    self.assertNotEqual(out.returncode, 0)
    self.assertIn("model.d_model: 64 -> 128", out.stderr)
    self.assertIn("new --workdir", out.stderr)
    self.assertNotIn("Traceback", out.stderr)
    self.assertNotIn("Parameters:", out.stderr)   # stopped before building anything
    self.assertFalse(os.path.exists(os.path.join(wd, "corrupt_checkpoints")))
    self.assertEqual(
        {n: sorted(os.listdir(os.path.join(wd, "checkpoints", n))) for n in ("30", "40")},
        before)
    # More steps: the checkpoints fit, but the run changes: only with the flag.
    more = (*FLAGS, f"--config.num_train_steps={STEPS + 4}")
    out = tu.run(tu.main_cmd(wd, *more))
    self.assertNotEqual(out.returncode, 0)
    self.assertIn(f"num_train_steps: {STEPS} -> {STEPS + 4}", out.stderr)
    self.assertIn("--accept_config_change", out.stderr)
    self.assertNotIn("Traceback", out.stderr)
    # Observation settings change freely; the right config resumes.
    out = tu.run(tu.main_cmd(wd, *more, "--config.log_every=2", "--accept_config_change"))
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertIn(f"Resumed from checkpoint step {STEPS}", out.stderr)
    self.assertIn("Config change on resume: log_every: 10 -> 2", out.stderr)
    self.assertEqual(_steps(wd)[-1], STEPS + 4)
    with open(os.path.join(wd, "config.json")) as f:   # the next resume compares with this
      self.assertEqual(json.load(f)["num_train_steps"], STEPS + 4)

  def test_checkpoint_that_does_not_fit_the_model_is_left_in_place(self):
    """Restoring with another model's state (same config file, other code) moves nothing."""
    from configs import tiny  # pylint: disable=g-import-not-at-top
    from train.state import checkpointing  # pylint: disable=g-import-not-at-top
    from train.state import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
    wd = self._fresh("misfit", from_ref=True)
    cfg = tiny.get_config()
    cfg.model.d_ff = 512
    abstract = trainer_lib.Trainer(cfg).abstract_state()
    with self.assertRaisesRegex(checkpointing.CheckpointError,
                                r"checkpoint step 40 .* does not fit the model of this "
                                r"config: params\.blocks\.0\.ffn\.w_down: stored "
                                r"float32\[256, 64\], this config float32\[512, 64\].*"
                                r"Nothing was moved"):
      checkpointing.restore_latest(wd, abstract)
    self.assertEqual(_steps(wd), [30, 40])
    self.assertFalse(os.path.exists(checkpointing.quarantine_dir(wd)))

  def test_evaluate_cli(self):
    out = tu.run([sys.executable, "-m", "train.evaluate", f"--workdir={self.ref}",
                  "--eval_batches=2"])
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    result = json.loads(out.stdout)
    self.assertEqual(result["step"], STEPS)
    for key in ("loss", "perplexity", "sparsity", "active_per_token",
                "max_tile_nnz", "overflow_rows"):
      self.assertIn(key, result)
    self.assertLen(result["sparsity"], 2)  # tiny has 2 layers
    with open(os.path.join(self.ref, f"eval_step_{STEPS}.json")) as f:
      self.assertEqual(json.load(f), result)
    bad = tu.run([sys.executable, "-m", "train.evaluate", f"--workdir={self.ref}",
                  "--step=7"])
    self.assertNotEqual(bad.returncode, 0)
    self.assertIn("error: no checkpoint for step 7", bad.stderr)
    self.assertNotIn("Traceback", bad.stderr)


class DamagedReadNoiseTest(absltest.TestCase):
  """The filter that keeps a failed restore's asyncio noise off stderr."""

  def _never_retrieved(self, message):
    """Lets asyncio report a future whose exception nobody retrieved."""
    import asyncio  # pylint: disable=g-import-not-at-top
    import gc  # pylint: disable=g-import-not-at-top
    import logging  # pylint: disable=g-import-not-at-top
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    loop = asyncio.new_event_loop()
    try:
      fut = loop.create_future()
      fut.set_exception(ValueError(message))
      del fut
      gc.collect()
    finally:
      loop.close()
      logger.removeHandler(handler)
    return [r for r in records if "never retrieved" in r.getMessage()]

  def test_drops_reports_about_damaged_steps_only(self):
    from train.state import checkpointing  # pylint: disable=g-import-not-at-top
    wd = tempfile.mkdtemp(prefix="twell_noise_test_")
    self.addCleanup(shutil.rmtree, wd, ignore_errors=True)
    checkpointing._silence_damaged_read_noise()  # pylint: disable=protected-access
    step_dir = os.path.join(checkpointing.checkpoint_dir(wd), "30")
    about_step = f'Error reading "w/.zarray" in "{step_dir}/state/"'
    self.assertLen(self._never_retrieved(about_step), 1)  # not damaged yet
    checkpointing._mark_damaged(wd, 30)  # pylint: disable=protected-access
    self.assertEmpty(self._never_retrieved(about_step))
    # Other steps and unrelated failures are still reported.
    other = os.path.join(checkpointing.checkpoint_dir(wd), "300", "state")
    self.assertLen(self._never_retrieved(f"Error reading {other}"), 1)
    self.assertLen(self._never_retrieved("something else broke"), 1)


if __name__ == "__main__":
  absltest.main()
