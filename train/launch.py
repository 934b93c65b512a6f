r"""Runs a training command as N processes on this host, one per GPU: python -m train.launch.

    python -m train.launch --num_processes=4 -- --config=configs/paper_1p5b.py --workdir=D
    JAX_PLATFORMS=cpu python -m train.launch --num_processes=2 --host_devices=2 -- \
        --config=configs/tiny.py --workdir=D          # the CPU: 2 processes x 2 host devices

Everything after `--` goes to `python -m train.main` (or `--module`) in every process; the
processes find each other through JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID, each with one GPU (`train.runtime.launcher`). Each process's lines come out
prefixed with its id. The launcher exits with 0 once every process has ended well, else
with the first failure's status, after giving the others `--grace_s` to end on their own
(a lost process ends them within their --peer_timeout_s) and killing the rest.

SIGTERM or Ctrl-C here is passed to every process as SIGTERM: they agree on a step, write
its checkpoint and stop (exit 143); rerunning the same command resumes. A second one kills
them; so does the launcher's own end, however it comes. `--stop_after_s`
does the same after that many seconds: a run longer than a machine's time limit continues
over several calls.
"""

import signal
import sys
import threading

from absl import app
from absl import flags

from train.runtime import launcher

flags.DEFINE_integer("num_processes", None, "How many processes (one GPU each).")
flags.DEFINE_string("module", "train.main", "The Python module every process runs.")
flags.DEFINE_integer("port", 0, "The coordinator's port on localhost (0: a free one).")
flags.DEFINE_integer("host_devices", 1, "Without GPUs: host devices per process.")
flags.DEFINE_enum("isolate", "local_device_ids", list(launcher.ISOLATIONS),
                  "How a process gets its GPU: JAX_LOCAL_DEVICE_IDS (every GPU visible to "
                  "CUDA) or CUDA_VISIBLE_DEVICES (only its own).")
flags.DEFINE_float("grace_s", 60.0, "After the first process fails, how long the others "
                   "may take to end on their own before they are killed.")
flags.DEFINE_string("process_logs", None, "Each process's output to "
                    "PROCESS_LOGS/process_<I>.log; only process 0's is echoed here.")
flags.DEFINE_float("stop_after_s", None, "SIGTERM every process after this many seconds "
                   "(checkpoint, stop; exit 143).")
flags.mark_flag_as_required("num_processes")


def main(argv):
  f = flags.FLAGS
  command = [sys.executable, "-m", f.module, *argv[1:]]
  try:
    job = launcher.LocalJob(command, f.num_processes, port=f.port or None,
                            host_devices=f.host_devices, isolate=f.isolate,
                            log_dir=f.process_logs)
  except ValueError as e:
    sys.exit(f"error: {e}")
  job.say(f"{f.num_processes} processes of {' '.join(command[1:])} (coordinator localhost:"
          f"{job.port}, " + (f"GPUs {','.join(job.gpus[:f.num_processes])}" if job.gpus
                             else f"{f.host_devices} host device(s) each") + ")")

  stops = []

  def stop(why: str) -> None:
    if stops:   # a second request: at once
      job.say(f"{why} again: SIGKILL to every process")
      job.signal(signal.SIGKILL)
      return
    stops.append(why)
    job.say(f"{why}: SIGTERM to every process")
    job.signal(signal.SIGTERM)

  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, _: stop(f"received {signal.Signals(signum).name}"))
  job.start()
  if f.stop_after_s is not None:
    timer = threading.Timer(f.stop_after_s, stop, (f"{f.stop_after_s:.0f} s passed",))
    timer.daemon = True
    timer.start()
  sys.exit(launcher.job_status(job.wait(grace_s=f.grace_s)))


if __name__ == "__main__":
  app.run(main)
