r"""Kill and resume on the machine's devices: does a SIGKILLed run continue the same run?

    python -m benchmarks.acceptance.kill_resume --out=kill_resume.json -- --config.mesh.data=2
    python -m benchmarks.acceptance.kill_resume --config=configs/tiny.py --steps=20 --every=5   # CPU

Three `python -m train.main` runs of the same command (`--config`, `--steps`, checkpoints
every `--every` steps, all kept, plus the flags after `--`):

  1. uninterrupted, in WORKDIR/ref;
  2. in WORKDIR/killed, SIGKILLed once its first checkpoint is committed;
  3. the same command again in WORKDIR/killed, which must resume from that checkpoint.

Reported: the step the run was killed after, whether the checkpoint it resumed from holds the
same train state as the uninterrupted run's checkpoint of that step (every array, params,
optimizer state, step, RNG, dead-feature counters), and whether both runs end with the same
parameters (bit for bit, and the largest difference). XLA's deterministic GPU reductions are
switched on (`--xla_gpu_deterministic_ops`) so that equal programs give equal bits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np


def _define_flags():
  flags.DEFINE_string("config", "configs/small.py", "training config")
  flags.DEFINE_integer("steps", 60, "training steps of each run")
  flags.DEFINE_integer("every", 20, "checkpoint interval")
  flags.DEFINE_string("workdir", None, "where the two runs go (default: a temporary dir)")
  flags.DEFINE_integer("timeout", 900, "seconds per run")
  flags.DEFINE_string("out", None, "write the result as JSON here")


def _cmd(fl, workdir, extra):
  return [sys.executable, "-m", "train.main", f"--config={fl.config}", f"--workdir={workdir}",
          f"--config.num_train_steps={fl.steps}", f"--config.checkpoint_every={fl.every}",
          f"--config.keep_checkpoints={fl.steps // fl.every + 1}", "--config.eval_every=0",
          *extra]


def deterministic_env() -> dict:
  """This process's environment with XLA's deterministic GPU reductions on and the repository
  on the path: equal programs then give equal bits."""
  env = dict(os.environ)
  xla = env.get("XLA_FLAGS", "")
  if "xla_gpu_deterministic_ops" not in xla:
    env["XLA_FLAGS"] = (xla + " --xla_gpu_deterministic_ops=true").strip()
  env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _committed(workdir) -> list[int]:
  """Committed checkpoint steps (orbax writes under a temporary name, then renames)."""
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def state(workdir, step):
  """The train state of checkpoint `step`, restored on this process's devices (any backend:
  the FFN implementation of the run does not change the state's layout)."""
  from train.state import checkpointing  # pylint: disable=import-outside-toplevel
  from train.state import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel
  _, meta = checkpointing.read_meta(workdir, step)
  cfg = ml_collections.ConfigDict(meta["config"])
  cfg.mesh.update(data=-1, fsdp=1)   # this process's devices, whatever the run used
  cfg.model.update(ffn_implementation="dense", interpret=False)
  tr = trainer_lib.Trainer(cfg)
  mngr = checkpointing.make_manager(workdir, read_only=True)
  try:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    out = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(tr.abstract_state())))
  finally:
    mngr.close()
  return jax.device_get(out.state)


def compare(a, b) -> dict:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  diff = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             if np.size(x) else 0.0 for x, y in zip(la, lb))
  return {"equal": all(np.array_equal(x, y) for x, y in zip(la, lb)), "max_abs_diff": diff}


def main(argv):
  from train.runtime import metrics  # pylint: disable=import-outside-toplevel
  metrics.quiet_library_logs()
  fl = flags.FLAGS
  extra = argv[1:]
  root = fl.workdir or tempfile.mkdtemp(prefix="twell_kill_resume_")
  ref, killed = os.path.join(root, "ref"), os.path.join(root, "killed")
  env = deterministic_env()
  t0 = time.time()
  out = subprocess.run(_cmd(fl, ref, extra), env=env, timeout=fl.timeout,
                       capture_output=True, text=True)
  if out.returncode:
    sys.exit(f"the uninterrupted run failed:\n{out.stderr[-3000:]}")
  print(f"uninterrupted run: {time.time() - t0:.0f}s", flush=True)
  proc = subprocess.Popen(_cmd(fl, killed, extra), env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + fl.timeout
  while not _committed(killed) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  at = max(_committed(killed), default=None)
  if proc.returncode != -signal.SIGKILL or at is None or at >= fl.steps:
    sys.exit(f"could not kill the run between checkpoints (exit {proc.returncode}, "
             f"checkpoints {_committed(killed)}); use more --steps")
  print(f"killed after the checkpoint of step {at}", flush=True)
  out = subprocess.run(_cmd(fl, killed, extra), env=env, timeout=fl.timeout,
                       capture_output=True, text=True)
  if out.returncode:
    sys.exit(f"the resumed run failed:\n{out.stderr[-3000:]}")
  result = {
      "command": _cmd(fl, "WORKDIR", extra), "killed_after_step": at,
      "resumed": f"Resumed from checkpoint step {at}" in out.stderr,
      "state_at_resume": compare(state(killed, at), state(ref, at)),
      "final_state": compare(state(killed, fl.steps), state(ref, fl.steps)),
      "devices": [str(d) for d in jax.devices()],
  }
  print(json.dumps(result, indent=1), flush=True)
  if fl.out:
    with open(fl.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  jax.config.config_with_absl()
  app.run(main)
