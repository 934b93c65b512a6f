"""Two CPU processes with two host devices each train, checkpoint and resume.

The processes are joined through the trainer's own flags (`python -m train.main
--coordinator_address=... --num_processes=2 --process_id=I`, gloo collectives).
The first run uses a data=2 x fsdp=2 mesh over the four devices (parameters and
optimizer state split over fsdp); the rerun resumes on data=4 (each process runs the step
per device and reduces the gradients across processes), restoring the
sharded checkpoint onto another mesh. Each process reads its own share of the
documents; the checkpoint must hold both data positions and the rerun must
resume each process from its own.
"""

import json
import os
import socket
import subprocess
import tempfile

from absl.testing import absltest

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


if __name__ == "__main__":
  absltest.main()
