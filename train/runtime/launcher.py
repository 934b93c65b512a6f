"""N processes of one command on this host, joined into one JAX system: `LocalJob`.

What a cluster's launcher (srun, a Kubernetes indexed Job) does for a job, on one machine,
for `python -m train.launch`, the tests and the benchmarks. Each process gets:

  JAX_COORDINATOR_ADDRESS=localhost:PORT, JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=I
      read by `train.runtime.distributed` (PORT: a free one unless given);
  one GPU where the host has GPUs: JAX_LOCAL_DEVICE_IDS=I (`isolate="local_device_ids"`, the
      default: every GPU stays visible to CUDA, so NCCL may copy between the processes' GPUs
      directly, as with one process) or CUDA_VISIBLE_DEVICES=<its GPU> (`"visible_devices"`,
      a scheduler's isolation). GPUs are CUDA_VISIBLE_DEVICES's if set, else nvidia-smi's;
  on the CPU, `host_devices` host devices (--xla_force_host_platform_device_count);
  the rest of this process's environment as it is (NCCL_NVLS_ENABLE=0 and the like pass on).

Every line a process writes (stdout and stderr) comes out prefixed with "[I] ", and is kept
(`output(i)`); with `log_dir`, each process's lines go to log_dir/process_<I>.log and only
process 0's are echoed. `wait` returns when every process has ended: after the first one
fails, the others get `grace_s` to end on their own (a lost process ends them within the
watch's timeout, `train.runtime.peer_watch`), then are killed.

This module starts no JAX: the processes need the GPUs whole.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TextIO

ISOLATIONS = ("local_device_ids", "visible_devices")


@dataclasses.dataclass(frozen=True)
class Ended:
  """How process `process` ended: its exit status (-N: killed by signal N) and when, in
  seconds since the job started."""
  process: int
  returncode: int
  seconds: float


# Runs argv[2:] in place of itself once the kernel will SIGKILL it when the thread that started
# it (pid argv[1]'s) ends (PR_SET_PDEATHSIG, Linux): no fork-time Python code in a launcher
# with threads. A parent gone before that, it ends at once.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; "
                    "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(137); "
                    "os.execvp(sys.argv[2], sys.argv[2:])")


def _dying_with_this_process(command: list[str]) -> list[str]:
  if not sys.platform.startswith("linux"):
    return command
  return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def host_gpus(env=None) -> list[str]:
  """This host's GPUs as CUDA_VISIBLE_DEVICES names them: the variable's entries if set,
  else one per line of `nvidia-smi -L`; none when JAX_PLATFORMS names neither cuda nor gpu."""
  env = os.environ if env is None else env
  platforms = env.get("JAX_PLATFORMS", "")
  if platforms and not any(p in platforms for p in ("cuda", "gpu")):
    return []
  visible = env.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return [g for g in visible.split(",") if g.strip() not in ("", "-1")]
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def with_host_devices(xla_flags: str, n: int) -> str:
  """`xla_flags` with `n` host devices (any earlier count replaced)."""
  kept = [f for f in xla_flags.split() if "xla_force_host_platform_device_count" not in f]
  return " ".join(kept + [f"--xla_force_host_platform_device_count={n}"])


def process_env(index: int, count: int, port: int, *, gpus: list[str], host_devices: int = 1,
                isolate: str = "local_device_ids", base=None) -> dict:
  """The environment of process `index` of `count` (module docstring)."""
  env = dict(os.environ if base is None else base)
  env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(count),
             JAX_PROCESS_ID=str(index), PYTHONUNBUFFERED="1")
  if gpus:
    if isolate == "visible_devices":
      env["CUDA_VISIBLE_DEVICES"] = gpus[index]
    else:   # an ordinal among the GPUs CUDA shows this process
      env["JAX_LOCAL_DEVICE_IDS"] = str(index)
  else:
    env["XLA_FLAGS"] = with_host_devices(env.get("XLA_FLAGS", ""), host_devices)
  return env


def check_settings(num_processes: int, gpus: list[str], host_devices: int,
                   isolate: str) -> None:
  """ValueError naming the setting that cannot run."""
  if num_processes < 1:
    raise ValueError(f"num_processes={num_processes}: must be at least 1")
  if host_devices < 1:
    raise ValueError(f"host_devices={host_devices}: must be at least 1")
  if isolate not in ISOLATIONS:
    raise ValueError(f"isolate={isolate!r}: must be one of {', '.join(ISOLATIONS)}")
  if gpus and num_processes > len(gpus):
    raise ValueError(f"num_processes={num_processes}: this host shows {len(gpus)} GPUs "
                     f"({','.join(gpus)}), one per process")


class LocalJob:
  """`command` (argv) as `num_processes` processes (module docstring)."""

  def __init__(self, command: list[str], num_processes: int, *, port: int | None = None,
               gpus: list[str] | None = None, host_devices: int = 1,
               isolate: str = "local_device_ids", env: dict | None = None,
               out: TextIO | None = sys.stdout, log_dir: str | None = None,
               cwd: str | None = None):
    self.gpus = host_gpus(env) if gpus is None else list(gpus)
    check_settings(num_processes, self.gpus, host_devices, isolate)
    self.command, self.count = list(command), num_processes
    self.port = port or free_port()
    self._envs = [process_env(i, num_processes, self.port, gpus=self.gpus,
                              host_devices=host_devices, isolate=isolate, base=env)
                  for i in range(num_processes)]
    self._out, self._log_dir, self._cwd = out, log_dir, cwd
    self._lines: list[list[str]] = [[] for _ in range(num_processes)]
    self._write_lock = threading.RLock()   # reentrant: `say` from a signal handler
    self.processes: list[subprocess.Popen] = []
    self.ended: dict[int, Ended] = {}     # filled in as the processes end
    self._threads: list[threading.Thread] = []
    self.t0 = None

  def start(self) -> "LocalJob":
    """Starts the processes. They are killed when the thread that starts them ends (Linux):
    a launcher killed outright leaves no process holding a GPU; start a job from a thread
    that outlives it."""
    self.t0 = time.monotonic()
    if self._log_dir:
      os.makedirs(self._log_dir, exist_ok=True)
    for env in self._envs:
      self.processes.append(subprocess.Popen(
          _dying_with_this_process(self.command), env=env, cwd=self._cwd,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          text=True, errors="replace", bufsize=1))
    for i, p in enumerate(self.processes):
      for target in (self._read, self._await):
        thread = threading.Thread(target=target, args=(i, p), daemon=True)
        thread.start()
        self._threads.append(thread)
    return self

  def _read(self, i: int, p: subprocess.Popen) -> None:
    path = os.path.join(self._log_dir, f"process_{i}.log") if self._log_dir else None
    log = open(path, "w") if path else None  # pylint: disable=consider-using-with
    try:
      for line in p.stdout:
        self._lines[i].append(line)
        if log is not None:
          log.write(line)
          log.flush()
        if self._out is not None and (log is None or i == 0):
          self.say(line.rstrip("\n"), prefix=f"[{i}] ")
    finally:
      if log is not None:
        log.close()

  def _await(self, i: int, p: subprocess.Popen) -> None:
    """Records when process `i` ends (its own thread: the moment, not when `wait` looks)."""
    p.wait()
    self.ended[i] = Ended(i, p.returncode, time.monotonic() - self.t0)

  def say(self, line: str, prefix: str = "[launch] ") -> None:
    """One line to the job's output, never interleaved with a process's."""
    if self._out is not None:
      with self._write_lock:
        self._out.write(prefix + line + "\n")
        self._out.flush()

  def output(self, i: int) -> str:
    """Everything process `i` has written so far."""
    return "".join(self._lines[i])

  def seconds(self) -> float:
    """Seconds since the job started."""
    return time.monotonic() - self.t0

  def signal(self, sig: int, processes=None) -> None:
    """Sends `sig` to the listed processes (default: all) that still run."""
    for i in range(self.count) if processes is None else processes:
      if self.processes[i].poll() is None:
        self.processes[i].send_signal(sig)

  def wait(self, timeout_s: float | None = None, grace_s: float = 60.0) -> list[Ended]:
    """Waits for every process (module docstring); how each ended, in process order. Past
    `timeout_s` (seconds since the start) every process still running is killed and
    TimeoutError raised."""
    told, first_failure, killed = set(), None, False
    while len(told) < self.count:
      for i, e in sorted(self.ended.copy().items()):
        if i in told:
          continue
        told.add(i)
        self.say(f"process {i} {describe_status(e.returncode)} after {e.seconds:.1f} s")
        if e.returncode != 0 and first_failure is None and len(told) < self.count:
          first_failure = e.seconds
          self.say(f"the others have {grace_s:.0f} s to end on their own")
      now = self.seconds()
      if first_failure is not None and now - first_failure > grace_s and not killed:
        self.say(f"killing the processes still running {grace_s:.0f} s after the first "
                 "failure")
        self.signal(signal.SIGKILL)
        killed = True
      if timeout_s is not None and now > timeout_s:
        self.signal(signal.SIGKILL)
        for p in self.processes:
          p.wait()
        raise TimeoutError(f"the job ran past {timeout_s:.0f} s: killed")
      time.sleep(0.05)
    for thread in self._threads:
      thread.join(timeout=10)
    return [self.ended[i] for i in range(self.count)]


def describe_status(returncode: int) -> str:
  if returncode == 0:
    return "ended"
  if returncode < 0:
    try:
      return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
      return f"was killed by signal {-returncode}"
  return f"exited with status {returncode}"


def job_status(ended: list[Ended]) -> int:
  """The job's exit status: 0 if every process ended well, else the first failure's (a
  signal N as 128 + N, as a shell reports it)."""
  failures = sorted((e for e in ended if e.returncode != 0), key=lambda e: e.seconds)
  if not failures:
    return 0
  code = failures[0].returncode
  return 128 - code if code < 0 else code
