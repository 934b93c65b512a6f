"""Fault injection through the CLI: SIGTERM and SIGKILL at random moments, and checkpoint
writes that fail mid-way.

Every trial trains a small model (the tiny config at d_model=32) in a subprocess that
saves a checkpoint after every step, so a fault at a random moment lands in or between
checkpoint writes, and is checked against one uninterrupted reference run that kept every
step's checkpoint:
  * SIGTERM (preemption): the run stops after the current step with exit status 143 and
    a checkpoint of that step;
  * SIGKILL during the writes: no complete checkpoint is lost (the newest one seen before
    the kill is still there) and none is damaged;
  * a write that fails mid-way (a file size limit, as when the disk fills up): the run
    stops with a one-line error naming the complete checkpoints, which are kept (with
    keep_checkpoints=1, so a failed write must not let the retention delete the last one).
After each trial the newest checkpoint restores without being quarantined, at the same
parameters and data position as the reference at that step (bit for bit); for each kind of
fault one workdir is also rerun to the end and matches the reference's final parameters.
The trial seeds are fixed; a failure message names the trial.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from absl.testing import absltest

import train_test_util as tu

STEPS = 30
_SHAPE = ("--config.model.d_model=32", "--config.model.n_heads=2", "--config.model.n_kv_heads=1",
          "--config.data.seq_len=32", "--config.batch_size=8")
_RUN = (*_SHAPE, f"--config.num_train_steps={STEPS}", "--config.eval_every=0",
        "--config.log_every=5", "--config.l1_coeff=3e-4", "--config.checkpoint_every=1")
REF_FLAGS = (*_RUN, "--config.keep_checkpoints=100")
TRIAL_FLAGS = (*_RUN, "--config.keep_checkpoints=2")
# The disk-full trials keep one checkpoint: a failed write must not let the retention
# policy delete it.
DISK_FULL_FLAGS = (*_RUN, "--config.keep_checkpoints=1")
# Cheap compiles in every run (the reference too, so the numerics are the same).
ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def _micro_config():
  return tu.micro_config(num_train_steps=STEPS)   # the shapes of _SHAPE


def _writing(workdir) -> bool:
  d = os.path.join(workdir, "checkpoints")
  return os.path.isdir(d) and any("tmp" in n for n in os.listdir(d))


class FaultInjectionTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    from train.state import checkpointing  # pylint: disable=g-import-not-at-top
    from train.state import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
    cls.ckpt = checkpointing
    cls.root = tempfile.mkdtemp(prefix="twell_faults_")
    cls.ref = os.path.join(cls.root, "ref")
    out = tu.run(tu.main_cmd(cls.ref, *REF_FLAGS), **ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert checkpointing.steps_on_disk(cls.ref) == list(range(1, STEPS + 1))
    cls.abstract = trainer_lib.Trainer(_micro_config()).abstract_state()
    cls._ref_params = {}

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.root, ignore_errors=True)
    super().tearDownClass()

  def _ref_params_at(self, step):
    if step not in self._ref_params:
      self._ref_params[step] = self.ckpt.restore_params(self.ref, self.abstract["params"], step)
    return self._ref_params[step]

  def _ref_data_at(self, step):
    with open(os.path.join(self.ref, "checkpoints", str(step), "data", "metadata")) as f:
      return json.load(f)

  def _workdir(self, name):
    path = os.path.join(self.root, name)
    shutil.rmtree(path, ignore_errors=True)
    return path

  def _assert_resumable(self, wd, seen, trial):
    """The newest checkpoint is at least `seen`, restores without quarantine, and equals
    the reference at its step."""
    steps = self.ckpt.steps_on_disk(wd)
    if seen is not None:
      self.assertGreaterEqual(max(steps, default=-1), seen,
                              f"{trial}: a complete checkpoint was lost ({steps})")
    mngr, restored = self.ckpt.restore_latest(wd, self.abstract)
    mngr.close()
    self.assertFalse(os.path.exists(self.ckpt.quarantine_dir(wd)),
                     f"{trial}: a committed checkpoint was damaged")
    if not steps:
      self.assertIsNone(restored)
      return None
    step = restored["step"]
    self.assertEqual(step, max(steps), trial)
    self.assertTrue(tu.tree_equal(restored["state"]["params"], self._ref_params_at(step)),
                    f"{trial}: step {step} differs from the reference")
    self.assertEqual(restored["data"], self._ref_data_at(step), trial)
    return step

  def _assert_rerun_matches_reference(self, wd, resume_from):
    out = tu.run(tu.main_cmd(wd, *TRIAL_FLAGS), **ENV)
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertIn(f"Resumed from checkpoint step {resume_from}", out.stderr)
    final = self.ckpt.restore_params(wd, self.abstract["params"], STEPS)
    self.assertTrue(tu.tree_equal(final, self._ref_params_at(STEPS)),
                    "the resumed run ended elsewhere than the uninterrupted one")

  def test_sigterm_at_random_moments_checkpoints_the_current_step(self):
    rng = random.Random(5)
    preempted = []
    for trial in range(3):
      wd = self._workdir(f"term{trial}")
      proc = subprocess.Popen(tu.main_cmd(wd, *TRIAL_FLAGS), cwd=tu.REPO,
                              env=tu.run_env(**ENV), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
      lines, started = [], threading.Event()

      def read(proc=proc, lines=lines, started=started):
        for line in proc.stderr:
          lines.append(line)
          if "Devices:" in line:   # train_and_evaluate runs: SIGTERM is handled from here
            started.set()
      reader = threading.Thread(target=read)
      reader.start()
      self.assertTrue(started.wait(240), "".join(lines)[-3000:])
      time.sleep(rng.uniform(0.0, 4.5))
      proc.send_signal(signal.SIGTERM)
      proc.wait(240)
      reader.join()
      err = "".join(lines)
      if proc.returncode == 0:   # finished before the signal
        continue
      self.assertEqual(proc.returncode, 143, f"trial {trial}: {err[-3000:]}")
      self.assertNotIn("Traceback", err)
      m = re.search(r"stopped: preempted \(SIGTERM\) after step (\d+): checkpoint of step "
                    r"\1 written", err)
      self.assertIsNotNone(m, err[-3000:])
      step = int(m.group(1))
      self.assertEqual(self._assert_resumable(wd, step, f"SIGTERM trial {trial}"), step)
      preempted.append((wd, step))
    self.assertNotEmpty(preempted, "every run finished before its SIGTERM")
    self._assert_rerun_matches_reference(*preempted[0])

  def test_sigkill_during_checkpoint_writes_loses_nothing(self):
    rng = random.Random(7)
    killed = []
    for trial in range(3):
      wd = self._workdir(f"kill{trial}")
      proc = subprocess.Popen(tu.main_cmd(wd, *TRIAL_FLAGS), cwd=tu.REPO,
                              env=tu.run_env(**ENV), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
      deadline = time.time() + 240
      while not _writing(wd) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
      time.sleep(rng.uniform(0.0, 3.0))
      seen = max(self.ckpt.steps_on_disk(wd), default=None)
      proc.kill()
      proc.wait()
      self.assertEqual(proc.returncode, -signal.SIGKILL, f"trial {trial} ended first")
      step = self._assert_resumable(wd, seen, f"SIGKILL trial {trial}")
      if step is not None and step < STEPS:
        killed.append((wd, step))
    self.assertNotEmpty(killed)
    self._assert_rerun_matches_reference(*killed[0])

  def test_checkpoint_write_failing_midway_stops_with_a_clear_error(self):
    rng = random.Random(11)
    base = 10
    # KiB: the small limits fail the metadata files, the larger ones the arrays' data.
    for trial, (low, high) in enumerate([(8, 24), (24, 300), (300, 700)]):
      wd = self._workdir(f"full{trial}")
      os.makedirs(os.path.join(wd, "checkpoints"))
      shutil.copy(os.path.join(self.ref, "config.json"), wd)
      shutil.copytree(os.path.join(self.ref, "checkpoints", str(base)),
                      os.path.join(wd, "checkpoints", str(base)))
      # Files may grow to `limit` bytes; past it a write fails with EFBIG (SIGXFSZ ignored),
      # as a full disk fails it: anywhere from the metadata files to the arrays' data, in the
      # first checkpoint written or a later one.
      limit = rng.randint(low, high)
      cmd = ["bash", "-c", f"ulimit -f {limit} && trap '' XFSZ && exec \"$@\"", "bash",
             *tu.main_cmd(wd, *DISK_FULL_FLAGS)]
      out = subprocess.run(cmd, cwd=tu.REPO, env=tu.run_env(**ENV), capture_output=True,
                           text=True, timeout=300, check=False)
      name = f"disk-full trial {trial} (files limited to {limit} KiB)"
      self.assertEqual(out.returncode, 1, f"{name}: {out.stderr[-3000:]}")
      m = re.fullmatch(r"error: writing a checkpoint to \S+ failed \(.*\); the complete "
                       r"checkpoints are steps \[([\d, ]+)\]; rerun the same command to "
                       r"resume from step (\d+) once the cause \(disk space, permissions\) "
                       r"is fixed\.", out.stderr.strip().splitlines()[-1])
      self.assertIsNotNone(m, f"{name}: {out.stderr[-3000:]}")
      complete, resume = [int(x) for x in m.group(1).split(",")], int(m.group(2))
      self.assertEqual(complete, self.ckpt.steps_on_disk(wd), name)
      self.assertEqual(resume, max(complete), name)
      self.assertEqual(self._assert_resumable(wd, base, name), resume)
    self._assert_rerun_matches_reference(wd, resume)


if __name__ == "__main__":
  absltest.main()
