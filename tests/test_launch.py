"""`train.launch` and `train.runtime.launcher`: N local processes of one command, each with
its id, the coordinator's address and its GPU (or host devices); their output prefixed; the
job's status; the others ended after a failure. No JAX runs here: the processes are small
Python commands."""

import io
import os
import signal
import subprocess
import sys
import time

from absl.testing import absltest

from train.runtime import launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> list[str]:
  return [sys.executable, "-c", code]


class EnvironmentTest(absltest.TestCase):

  def test_each_process_gets_its_id_the_coordinator_and_one_gpu(self):
    base = {"NCCL_NVLS_ENABLE": "0", "XLA_FLAGS": "--xla_dump_to=/d"}
    env = launcher.process_env(1, 4, 1234, gpus=["0", "1", "2", "3"], base=base)
    self.assertEqual(env["JAX_COORDINATOR_ADDRESS"], "localhost:1234")
    self.assertEqual((env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]), ("4", "1"))
    self.assertEqual(env["JAX_LOCAL_DEVICE_IDS"], "1")
    self.assertNotIn("CUDA_VISIBLE_DEVICES", env)
    self.assertEqual(env["NCCL_NVLS_ENABLE"], "0")       # the environment passes on
    self.assertEqual(env["XLA_FLAGS"], "--xla_dump_to=/d")
    env = launcher.process_env(1, 2, 1234, gpus=["4", "6"], isolate="visible_devices",
                               base=base)
    self.assertEqual(env["CUDA_VISIBLE_DEVICES"], "6")
    self.assertNotIn("JAX_LOCAL_DEVICE_IDS", env)

  def test_host_devices_without_gpus(self):
    env = launcher.process_env(0, 2, 1, gpus=[], host_devices=3, base={
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/d"})
    self.assertEqual(env["XLA_FLAGS"],
                     "--xla_dump_to=/d --xla_force_host_platform_device_count=3")

  def test_gpus_of_the_host(self):
    self.assertEqual(launcher.host_gpus({"JAX_PLATFORMS": "cpu"}), [])
    self.assertEqual(launcher.host_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}), ["2", "3"])
    self.assertEqual(launcher.host_gpus({"CUDA_VISIBLE_DEVICES": ""}), [])
    self.assertEqual(launcher.host_gpus({"JAX_PLATFORMS": "cuda",
                                         "CUDA_VISIBLE_DEVICES": "1"}), ["1"])

  def test_bad_settings_name_the_argument(self):
    for args, message in (((0, [], 1, "local_device_ids"), "num_processes=0: must be at least 1"),
                          ((2, [], 0, "local_device_ids"), "host_devices=0"),
                          ((2, [], 1, "cgroups"), "isolate='cgroups'"),
                          ((3, ["0", "1"], 1, "local_device_ids"),
                           "num_processes=3: this host shows 2 GPUs")):
      with self.assertRaisesRegex(ValueError, message):
        launcher.check_settings(*args)

  def test_job_status(self):
    e = launcher.Ended
    self.assertEqual(launcher.job_status([e(0, 0, 1.0), e(1, 0, 1.0)]), 0)
    self.assertEqual(launcher.job_status([e(0, 75, 9.0), e(1, -9, 2.0)]), 128 + 9)  # first
    self.assertEqual(launcher.job_status([e(0, 75, 9.0), e(1, 0, 2.0)]), 75)


class LocalJobTest(absltest.TestCase):

  def test_output_prefixed_and_kept_per_process(self):
    out = io.StringIO()
    job = launcher.LocalJob(_python(
        "import os; print('process', os.environ['JAX_PROCESS_ID'], 'of', "
        "os.environ['JAX_NUM_PROCESSES'], os.environ['JAX_COORDINATOR_ADDRESS'])"),
        3, gpus=[], port=4321, out=out).start()
    ended = job.wait(timeout_s=60)
    self.assertEqual([e.returncode for e in ended], [0, 0, 0])
    for i in range(3):
      self.assertEqual(job.output(i), f"process {i} of 3 localhost:4321\n")
      self.assertIn(f"[{i}] process {i} of 3 localhost:4321\n", out.getvalue())
      self.assertIn(f"[launch] process {i} ended after", out.getvalue())

  def test_a_failure_gives_the_others_grace_then_kills_them(self):
    out = io.StringIO()
    log_dir = self.create_tempdir().full_path
    job = launcher.LocalJob(_python(
        "import os, sys, time\n"
        "if os.environ['JAX_PROCESS_ID'] == '1': print('failing'); sys.exit(3)\n"
        "print('waiting', flush=True); time.sleep(60)"), 2, gpus=[], out=out,
        log_dir=log_dir).start()
    ended = job.wait(timeout_s=60, grace_s=1.0)
    self.assertEqual(ended[1].returncode, 3)
    self.assertEqual(ended[0].returncode, -signal.SIGKILL)
    self.assertLess(ended[0].seconds - ended[1].seconds, 10)
    self.assertEqual(launcher.job_status(ended), 3)
    text = out.getvalue()
    self.assertIn("[launch] process 1 exited with status 3", text)
    self.assertIn("the others have 1 s to end on their own", text)
    self.assertIn("[0] waiting", text)
    self.assertNotIn("[1] failing", text)      # with log_dir only process 0 is echoed
    with open(os.path.join(log_dir, "process_1.log")) as f:
      self.assertEqual(f.read(), "failing\n")

  def test_timeout_kills_everything(self):
    job = launcher.LocalJob(_python("import time; time.sleep(60)"), 2, gpus=[],
                            out=None).start()
    with self.assertRaisesRegex(TimeoutError, "ran past 1 s"):
      job.wait(timeout_s=1.0)
    self.assertEqual([p.returncode for p in job.processes], [-signal.SIGKILL] * 2)


class LaunchCliTest(absltest.TestCase):

  def _launch(self, *args):
    return subprocess.run([sys.executable, "-m", "train.launch", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))

  def test_runs_a_module_in_every_process_and_reports_the_first_failure(self):
    ok = self._launch("--num_processes=2", "--module=platform")
    self.assertEqual(ok.returncode, 0, ok.stderr)
    self.assertEqual(sum(line.startswith(("[0] ", "[1] ")) for line in ok.stdout.splitlines()),
                     2)
    self.assertIn("1 host device(s) each", ok.stdout)
    bad = self._launch("--num_processes=2", "--module=no_such_module_here", "--grace_s=5")
    self.assertEqual(bad.returncode, 1)
    self.assertIn("No module named no_such_module_here", bad.stdout)

  def test_stop_after_passes_sigterm_to_every_process(self):
    probe = self.create_tempdir()
    probe.create_file("sigterm_probe.py", content=(
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        "  print('stopping', os.environ['JAX_PROCESS_ID'], flush=True)\n"
        "  sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"))
    r = subprocess.run([sys.executable, "-m", "train.launch", "--num_processes=2",
                        "--module=sigterm_probe", "--stop_after_s=5"], cwd=REPO,
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, JAX_PLATFORMS="cpu",
                                PYTHONPATH=probe.full_path + os.pathsep + REPO))
    self.assertEqual(r.returncode, 143, r.stdout)
    self.assertIn("[launch] 5 s passed: SIGTERM to every process", r.stdout)
    for i in range(2):
      self.assertIn(f"[{i}] stopping {i}", r.stdout)
      self.assertIn(f"[launch] process {i} exited with status 143", r.stdout)

  def test_a_launcher_killed_outright_takes_its_processes_along(self):
    probe = self.create_tempdir()
    probe.create_file("sleeper.py", content=(
        "import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)\n"))
    launch = subprocess.Popen([sys.executable, "-m", "train.launch", "--num_processes=2",
                               "--module=sleeper"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, JAX_PLATFORMS="cpu",
                                       PYTHONPATH=probe.full_path + os.pathsep + REPO))
    pids = []
    for line in launch.stdout:
      if " pid " in line:
        pids.append(int(line.split()[-1]))
      if len(pids) == 2:
        break
    launch.kill()
    launch.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
      time.sleep(0.1)
    self.assertFalse([p for p in pids if os.path.exists(f"/proc/{p}")])

  def test_bad_argument(self):
    r = self._launch("--num_processes=0")
    self.assertEqual(r.returncode, 1)
    self.assertEqual(r.stderr.strip(), "error: num_processes=0: must be at least 1")


if __name__ == "__main__":
  absltest.main()
