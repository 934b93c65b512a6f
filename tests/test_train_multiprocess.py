"""Two CPU processes with two host devices each train, checkpoint and resume.

The processes are joined through the trainer's own flags (`python -m train.main
--coordinator_address=... --num_processes=2 --process_id=I`, gloo collectives).
The first run uses a data=2 x fsdp=2 mesh over the four devices (parameters and
optimizer state split over fsdp); the rerun resumes on data=4 (each process runs the step
per device and reduces the gradients across processes), restoring the
sharded checkpoint onto another mesh. Each process reads its own share of the
documents; the checkpoint must hold both data positions and the rerun must
resume each process from its own.

The cluster's acceptance run (`benchmarks.acceptance.multiprocess --smoke`: 2 processes of 2 host
devices) loses a process, the coordinator, and every process, each mid-run: the survivors of a
lost process end by themselves within 60 s, naming it; the reruns resume from the last
committed checkpoint and end with the uninterrupted run's train state; evaluate, generate and
export run on that checkpoint in one process; and the throughput of one process and of two is
read.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types

from absl.testing import absltest
import pytest

import train_test_util as tu

# The micro model of train_test_util.micro_config, as command-line overrides.
_MICRO = ("--config.model.d_model=32", "--config.model.n_heads=2",
          "--config.model.n_kv_heads=1", "--config.data.seq_len=32",
          "--config.batch_size=8", "--config.warmup_steps=2",
          "--config.l1_warmup_steps=0", "--config.log_every=2",
          "--config.eval_every=0", "--config.checkpoint_every=2",
          "--jax_disable_most_optimizations")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


class MultiProcessTest(absltest.TestCase):

  def _run_pair(self, wd, steps, data, fsdp, *extra):
    port = str(_free_port())
    env = tu.run_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = tu.main_cmd(wd, *_MICRO, f"--config.num_train_steps={steps}",
                      f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}",
                      f"--coordinator_address=localhost:{port}", "--num_processes=2", *extra)
    procs = [subprocess.Popen(cmd + [f"--process_id={i}"], cwd=tu.REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
      self.assertEqual(p.returncode, 0, err[-3000:])
    return [err for _, err in outs]

  def test_two_processes_checkpoint_both_data_positions_and_resume(self):
    tu.offline_data_dir()  # build once before two processes race for it
    wd = tempfile.mkdtemp(prefix="twell_mp_")
    logs = self._run_pair(wd, 3, data=2, fsdp=2)
    for i, log in enumerate(logs):
      self.assertIn(f"process {i}/2", log)
      self.assertIn("mesh {'data': 2, 'fsdp': 2} over 4 devices of 2 processes", log)
    with open(os.path.join(wd, "checkpoints", "3", "data", "metadata")) as f:
      states = json.load(f)["processes"]
    self.assertLen(states, 2)
    self.assertNotEqual(states[0], states[1])  # disjoint document shares
    # Resumes from step 3 on another mesh, one step more (a change the flag accepts): data=4,
    # where the step runs per device and reduces the gradients across the processes.
    logs = self._run_pair(wd, 4, 4, 1, "--accept_config_change")
    for log in logs:
      self.assertIn("Resumed from checkpoint step 3", log)
      self.assertIn("mesh {'data': 4, 'fsdp': 1}", log)
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      steps = [json.loads(line)["step"] for line in f]
    self.assertEqual(steps[-1], 4)
    self.assertNotIn(1, steps[steps.index(3) + 1:])  # no restart from 0

  def test_lost_processes_killed_jobs_and_reruns_as_a_cluster_runs_them(self):
    out = os.path.join(tempfile.mkdtemp(prefix="twell_mp_smoke_"), "mp.json")
    # The checks only: the throughput part times the dense model on GPUs (its CPU smoke would
    # add a minute of CI for no measure).
    r = subprocess.run([sys.executable, "-m", "benchmarks.acceptance.multiprocess", "--smoke",
                        "--parts=checks", f"--out={out}", f"--workdir={os.path.dirname(out)}"],
                       cwd=tu.REPO, env=tu.run_env(), capture_output=True, text=True,
                       timeout=900)
    self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
    with open(out) as f:
      result = json.load(f)
    (cell,) = result["cells"]
    self.assertEqual((cell["processes"], cell["devices"], cell["mesh"]), (2, 4, "fsdp=4"))
    self.assertEqual(cell["errors"], [])
    self.assertTrue(cell["passed"])
    self.assertEqual(sorted(k for k, v in cell["checks"].items() if v), sorted([
        "trained", "lost_mid_run", "coordinator_mid_run", "killed_mid_run",
        "lost_process_named", "lost_process_ends_the_others",
        "lost_coordinator_ends_the_others", "lost_resumed", "killed_resumed",
        "lost_same_state", "killed_same_state", "evaluate", "generate", "export_hf"]))
    # The watch's timeout is 10 s here: the survivor ends a little after it, well within 60.
    self.assertBetween(cell["lost_process_exit_s"], 10.0, 40.0)
    self.assertLess(cell["lost_coordinator_exit_s"], 60.0)
    self.assertLess(max(cell["killed_at"].values()), cell["steps"])
    log = os.path.join(os.path.dirname(out), "p2_fsdp=4", "logs", "lost", "process_0.log")
    with open(log) as f:
      lines = [l for l in f.read().splitlines() if l.startswith("error:")]
    self.assertLen(lines, 1)
    self.assertRegex(lines[0], r"^error: lost process 1 of 2 silent for 1\d s: killed, crashed "
                     r"or its host is gone; process 0 stops too \(exit 75\)\. Rerun the job: it "
                     r"resumes from its last committed checkpoint\.$")


@pytest.mark.gpu
def test_a_lost_process_on_gpus_ends_the_other():
  """Two processes, one GPU each (NCCL between them): the survivor of a SIGKILLed process,
  blocked in a collective that cannot finish, stops by itself within 60 s with the line naming
  the lost process."""
  from benchmarks.acceptance import multiprocess  # pylint: disable=g-import-not-at-top
  from train.runtime import launcher  # pylint: disable=g-import-not-at-top
  if len(launcher.host_gpus()) < 2:
    pytest.skip("needs two GPUs")
  wd = tempfile.mkdtemp(prefix="twell_mp_gpu_")
  s = multiprocess.settings(types.SimpleNamespace(
      processes=2, mesh="fsdp", smoke=False, host_devices=1, isolate="local_device_ids",
      timeout=600, config="configs/tiny.py", steps=2000, every=10, throughput_steps=0,
      log_every=10, peer_timeout_s=None), launcher.host_gpus())
  env = multiprocess.environment(s, deterministic=True)
  job = multiprocess.start(s, multiprocess.train_flags(s, os.path.join(wd, "run")), env,
                           os.path.join(wd, "logs"))
  kills = multiprocess.kill_at_first_commit({"run": job}, {"run": os.path.join(wd, "run")},
                                            {"run": [1]}, time.monotonic() + 600)
  step, at = kills["run"]
  assert step is not None and step < 2000, kills
  ended = job.wait(timeout_s=at + 120, grace_s=90)
  assert ended[0].returncode == 75, job.output(0)[-3000:]
  assert ended[0].seconds - at < 60
  assert "error: lost process 1 of 2 silent for" in job.output(0)


if __name__ == "__main__":
  absltest.main()
