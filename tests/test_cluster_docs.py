"""docs/cluster.md's commands, run as a cluster would run them, on the CPU (two processes of
two host devices each, the micro model, a few steps), all three at once:

  launch_cpu     the `train.launch` command as written (its workdir in a temporary directory);
  slurm_script   the batch script, run by bash with an `srun` on PATH that starts
                 SLURM_NTASKS tasks here with the variables srun sets for each (SLURM_PROCID,
                 SLURM_LOCALID, SLURM_STEP_NODELIST, ...), as `sbatch` would on one node; the
                 coordinator's port comes from JAX_COORDINATOR_PORT (a free one) instead of the
                 job id's;
  k8s_job        the indexed Job's container command, once per completion index, with the
                 Job's environment and JOB_COMPLETION_INDEX as Kubernetes sets it; the
                 coordinator is localhost (no cluster DNS here), and CONFIG, WORKDIR and
                 TRAIN_FLAGS are set for the CPU, as a user edits them.

Each must train with both processes joined and write its checkpoint.
"""

import os
import stat
import subprocess
import sys
import tempfile

from absl.testing import absltest
import yaml

import docs_blocks
import train_test_util as tu
from train.runtime import launcher

CPU_FLAGS = ("--config.model.d_model=32 --config.model.n_heads=2 --config.model.n_kv_heads=1 "
             "--config.data.seq_len=32 --config.batch_size=8 --config.num_train_steps=4 "
             "--config.log_every=2 --config.eval_every=0 --config.checkpoint_every=2 "
             "--config.mesh.data=2 --config.mesh.fsdp=2 --config.data.use_tfds=False "
             "--jax_disable_most_optimizations")

# srun for one node: SLURM_NTASKS tasks of its command, each with srun's per-task variables.
FAKE_SRUN = f"""#!{sys.executable}
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
  args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
step = {{"SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"], "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": str(n)}}
tasks = [subprocess.Popen(args, env={{**os.environ, **step, "SLURM_PROCID": str(i),
                                       "SLURM_LOCALID": str(i)}}) for i in range(n)]
codes = [t.wait() for t in tasks]
sys.exit(next((c for c in codes if c), 0))
"""


def _cpu_env(**extra) -> dict:
  env = tu.run_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", **extra)
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  return env


class ClusterDocsTest(absltest.TestCase):

  def _launch_cpu(self, tmp):
    wd = os.path.join(tmp, "launch")
    code = docs_blocks.find("launch_cpu").code.replace("/tmp/twell_cluster_cpu", wd)
    return [subprocess.Popen(["bash", "-c", code], cwd=tu.REPO, env=_cpu_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)], wd

  def _slurm(self, tmp):
    bin_dir, wd = os.path.join(tmp, "bin"), os.path.join(tmp, "slurm")
    os.makedirs(bin_dir)
    srun = os.path.join(bin_dir, "srun")
    with open(srun, "w") as f:
      f.write(FAKE_SRUN)
    os.chmod(srun, os.stat(srun).st_mode | stat.S_IXUSR)
    script = os.path.join(tmp, "train.sbatch")
    with open(script, "w") as f:
      f.write(docs_blocks.find("slurm_script").code)
    env = _cpu_env(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2",
                   JAX_COORDINATOR_PORT=str(launcher.free_port()), CONFIG="configs/tiny.py",
                   WORKDIR=wd, TRAIN_FLAGS=CPU_FLAGS)
    env["PATH"] = bin_dir + os.pathsep + env["PATH"]
    return [subprocess.Popen(["bash", script], cwd=tu.REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)], wd

  def _k8s(self, tmp):
    wd = os.path.join(tmp, "k8s")
    docs = list(yaml.safe_load_all(docs_blocks.find("k8s_job").code))
    job = next(d for d in docs if d["kind"] == "Job")
    service = next(d for d in docs if d["kind"] == "Service")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    self.assertEqual(spec["completionMode"], "Indexed")
    self.assertEqual(pod["subdomain"], service["metadata"]["name"])
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    self.assertEqual(int(env["JAX_NUM_PROCESSES"]), spec["completions"])
    self.assertEqual(env["JAX_COORDINATOR_ADDRESS"].split(":")[0],
                     f"{job['metadata']['name']}-0.{pod['subdomain']}")   # pod 0's DNS name
    n = 2   # two pods here, on the CPU
    env.update(JAX_NUM_PROCESSES=str(n), CONFIG="configs/tiny.py", WORKDIR=wd,
               TRAIN_FLAGS=CPU_FLAGS,
               JAX_COORDINATOR_ADDRESS=f"localhost:{launcher.free_port()}")
    cmd = container["command"] + container.get("args", [])
    return [subprocess.Popen(cmd, cwd=tu.REPO, env=_cpu_env(**env, JOB_COMPLETION_INDEX=str(i)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(n)], wd

  def test_launcher_slurm_script_and_kubernetes_job(self):
    tu.offline_data_dir()
    tmp = tempfile.mkdtemp(prefix="twell_cluster_docs_")
    runs = {"launch_cpu": self._launch_cpu(tmp), "slurm_script": self._slurm(tmp),
            "k8s_job": self._k8s(tmp)}
    for name, (procs, wd) in runs.items():
      outs = [p.communicate(timeout=600)[0] for p in procs]
      for p, out in zip(procs, outs):
        self.assertEqual(p.returncode, 0, f"{name}:\n{out[-3000:]}")
      text = "".join(outs)
      for i in range(2):
        self.assertIn(f"process {i}/2", text, name)
      self.assertIn("over 4 devices of 2 processes", text, name)
      self.assertEqual(tu.checkpoint_steps(wd), [2, 4], name)


if __name__ == "__main__":
  absltest.main()
