"""The benchmarks' cluster pieces without running them: a run continued over several
commands (`benchmarks.common.run_calls`), `benchmarks.whole_run`'s launch through `train.launch`, and
`benchmarks.acceptance.multiprocess`'s settings, commands and throughput reading."""

import json
import os
import subprocess
import sys
import types

from absl.testing import absltest

from benchmarks import whole_run
from benchmarks.acceptance import multiprocess
from benchmarks.common import run_calls

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RunCallsTest(absltest.TestCase):

  def test_calls_laid_end_to_end(self):
    wd = os.path.join(self.create_tempdir().full_path, "0_sparse")
    self.assertFalse(run_calls.continues(wd))
    os.makedirs(os.path.join(wd, "checkpoints", "40"))
    run_calls.record(wd, 1000.0, 500.0)
    calls = run_calls.record(wd, 2000.0, 480.0)
    self.assertTrue(run_calls.continues(wd))
    self.assertEqual(run_calls.total(calls, 100.0), 1080.0)
    seconds = run_calls.clock(calls, 3000.0)
    self.assertEqual(seconds(1010.0), 10.0)        # in the first call
    self.assertEqual(seconds(2005.0), 505.0)       # 500 s of the first, 5 of the second
    self.assertEqual(seconds(3002.0), 982.0)       # the last call
    self.assertEqual(run_calls.finish(wd), calls)
    self.assertFalse(run_calls.continues(wd))      # ended: the same command starts over

  def test_a_record_without_a_checkpoint_is_dropped(self):
    wd = os.path.join(self.create_tempdir().full_path, "0_sparse")
    with open(wd + ".calls.json", "w") as f:
      json.dump([{"start": 1.0, "wall_s": 2.0}], f)
    self.assertFalse(run_calls.continues(wd))      # stopped before its first checkpoint
    self.assertFalse(os.path.exists(wd + ".calls.json"))


class WholeRunLaunchTest(absltest.TestCase):

  def _fl(self, **kw):
    return types.SimpleNamespace(**{"processes": 1, "stop_after_s": None, "dense_flags": [],
                                    **kw})

  def test_one_process_is_the_plain_command(self):
    cmd = ["python", "-m", "train.main", "--config=c", "--workdir=/w/0_sparse"]
    self.assertEqual(whole_run.launched(self._fl(), cmd, "sparse", "/w/0_sparse"), cmd)

  def test_processes_and_a_time_limit_go_through_train_launch(self):
    cmd = ["python", "-m", "train.main", "--config=c", "--workdir=/w/0_dense_silu"]
    fl = self._fl(processes=4, stop_after_s=500.0, dense_flags=["--config.grad_accum_steps=1"])
    self.assertEqual(whole_run.launched(fl, cmd, "dense_silu", "/w/0_dense_silu"), [
        "python", "-m", "train.launch", "--num_processes=4",
        "--process_logs=/w/0_dense_silu.processes", "--stop_after_s=500.0", "--",
        "--config=c", "--workdir=/w/0_dense_silu", "--config.grad_accum_steps=1"])
    self.assertNotIn("--config.grad_accum_steps=1",
                     whole_run.launched(fl, cmd, "sparse", "/w/0_sparse"))


class MultiprocessBenchmarkTest(absltest.TestCase):

  def _fl(self, **kw):
    defaults = dict(processes=None, mesh="fsdp", smoke=False, host_devices=2,
                    isolate="local_device_ids", timeout=900, config="configs/small.py",
                    steps=40, every=10, throughput_steps=120, log_every=20,
                    peer_timeout_s=None)
    return types.SimpleNamespace(**{**defaults, **kw})

  def test_cells_on_gpus_and_on_the_cpu(self):
    s = multiprocess.settings(self._fl(), ["0", "1", "2", "3"])
    self.assertEqual((s["processes"], s["gpus"], s["mesh"]), (4, ["0", "1", "2", "3"], "fsdp=4"))
    self.assertIn("--config.batch_size=32", s["throughput_flags"])   # 8 rows a GPU
    s = multiprocess.settings(self._fl(processes=2, mesh="data"), ["0", "1", "2", "3"])
    self.assertEqual((s["gpus"], s["mesh"]), (["0", "1"], "data=2"))
    smoke = multiprocess.settings(self._fl(smoke=True), [])
    self.assertEqual((smoke["processes"], smoke["devices"], smoke["mesh"]), (2, 4, "fsdp=4"))
    self.assertEqual(smoke["peer_timeout_s"], 10.0)
    with self.assertRaisesRegex(Exception, "--processes=8: this host has 4 GPUs"):
      multiprocess.settings(self._fl(processes=8), ["0", "1", "2", "3"])

  def test_commands(self):
    s = multiprocess.settings(self._fl(peer_timeout_s=15.0), ["0", "1"])
    checks = multiprocess.train_flags(s, "/w/ref")
    for flag in ("--config=configs/small.py", "--config.num_train_steps=40",
                 "--config.checkpoint_every=10", "--config.keep_checkpoints=5",
                 "--config.layer_choice.background=False", "--workdir=/w/ref",
                 "--config.mesh.data=1", "--config.mesh.fsdp=2", "--peer_timeout_s=15.0"):
      self.assertIn(flag, checks)
    speed = multiprocess.train_flags(s, "/w/t", throughput=True)
    for flag in ("--config=configs/paper_0p5b.py:dense", "--config.checkpoint_every=0",
                 "--config.batch_size=16", "--config.grad_accum_steps=1"):
      self.assertIn(flag, speed)

  def test_tokens_per_s_leaves_out_the_first_step_and_the_warm_windows(self):
    wd = self.create_tempdir().full_path
    rows = [{"step": 1, "tokens_per_s": 10.0}, {"step": 20, "tokens_per_s": 50.0},
            {"step": 40, "tokens_per_s": 90.0}, {"step": 60, "tokens_per_s": 100.0},
            {"step": 80, "tokens_per_s": 104.0}, {"step": 100, "tokens_per_s": 96.0},
            {"step": 100, "eval/loss": 3.0}]
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
      f.writelines(json.dumps(dict(r, wall_time=float(r["step"]))) + "\n" for r in rows)
    self.assertEqual(multiprocess.tokens_per_s(wd), 100.0)

  def test_the_parts_of_a_cell_from_two_calls_join(self):
    checks = {"processes": 2, "devices": 2, "gpus": 2, "mesh": "fsdp=2", "parts": ["checks"],
              "checks": {"trained": True, "lost_same_state": True}, "errors": [],
              "lost_process_exit_s": 21.2, "seconds": 300.0}
    speed = {"processes": 2, "devices": 2, "gpus": 2, "mesh": "fsdp=2", "parts": ["throughput"],
             "checks": {}, "errors": [], "throughput": {"ratio": 0.99}, "seconds": 200.0}
    cells = [multiprocess.judge(dict(checks))]
    self.assertTrue(cells[0]["passed"])
    joined = multiprocess.add_cell(cells, multiprocess.judge(dict(speed)))
    self.assertLen(cells, 1)
    self.assertEqual(joined["parts"], ["checks", "throughput"])
    self.assertEqual((joined["lost_process_exit_s"], joined["throughput"]["ratio"],
                      joined["seconds"]), (21.2, 0.99, 500.0))
    self.assertTrue(joined["passed"])
    slow = dict(speed, throughput={"ratio": 0.95})
    self.assertFalse(multiprocess.add_cell([dict(checks)], slow)["passed"])   # below 0.98
    other = multiprocess.add_cell(cells, dict(speed, processes=4, devices=4, mesh="fsdp=4"))
    self.assertLen(cells, 2)
    self.assertFalse(other is joined)


class BadFlagsTest(absltest.TestCase):

  def _run(self, *args):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))

  def test_named_before_anything_runs(self):
    for args, message in (
        (("benchmarks.acceptance.multiprocess", "--smoke", "--parts=speed"),
         "--parts: unknown ['speed']; choose from checks, throughput"),
        (("benchmarks.acceptance.multiprocess", "--smoke", "--processes=1"),
         "--processes=1: a cell needs at least 2"),
        (("benchmarks.whole_run", "--smoke", "--processes=2", "--parallel"),
         "--processes: each run takes that many GPUs; not with --parallel")):
      r = self._run(*args)
      self.assertNotEqual(r.returncode, 0, args)
      self.assertIn(message, r.stderr, args)


if __name__ == "__main__":
  absltest.main()
