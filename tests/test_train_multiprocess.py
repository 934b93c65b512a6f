"""Two CPU processes (jax.distributed + gloo) train, checkpoint and resume.

Each process reads its own share of the documents; the checkpoint must hold
both data positions and a rerun must resume each process from its own.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

from absl.testing import absltest

import train_test_util as tu

_SCRIPT = textwrap.dedent("""
    import sys
    pid, port, wd, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_disable_most_optimizations", True)
    jax.distributed.initialize(f"localhost:{port}", num_processes=2,
                               process_id=pid)
    import train_test_util as tu
    from train import train_lib
    cfg = tu.micro_config(num_train_steps=steps, checkpoint_every=2)
    last = train_lib.train_and_evaluate(cfg, wd, accept_config_change=True)  # more steps
    print("DONE", jax.process_index(), jax.process_count(), last["loss"])
    """)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


class MultiProcessTest(absltest.TestCase):

  def _run_pair(self, wd, steps):
    port = str(_free_port())
    env = tu.run_env(PYTHONPATH=os.path.dirname(__file__) + os.pathsep +
                     tu.REPO)
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, str(i), port,
                               wd, str(steps)], cwd=tu.REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
      self.assertEqual(p.returncode, 0, err[-3000:])
    return [o for o, _ in outs]

  def test_two_processes_checkpoint_both_data_positions_and_resume(self):
    tu.offline_data_dir()  # build once before two processes race for it
    wd = tempfile.mkdtemp(prefix="twell_mp_")
    outs = self._run_pair(wd, 3)
    self.assertIn("DONE 0 2", outs[0])
    self.assertIn("DONE 1 2", outs[1])
    with open(os.path.join(wd, "checkpoints", "3", "data", "metadata")) as f:
      states = json.load(f)["processes"]
    self.assertLen(states, 2)
    self.assertNotEqual(states[0], states[1])  # disjoint document shares
    outs = self._run_pair(wd, 4)  # resumes from step 3
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      steps = [json.loads(line)["step"] for line in f]
    self.assertEqual(steps[-1], 4)
    self.assertNotIn(1, steps[steps.index(3) + 1:])  # no restart from 0


if __name__ == "__main__":
  absltest.main()
