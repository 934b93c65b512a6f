"""Several processes (one per host, or one per GPU) joined into one JAX system
(`jax.distributed`).

Every process runs the same command; they differ only in their process id:

  --coordinator_address=HOST:PORT   process 0's address, reachable from every host
  --num_processes=N                 how many processes
  --process_id=I                    this process's id, 0 <= I < N

Each defaults to the environment's JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID (what `train.launch` sets). With none of them set, a single process runs,
unless --distributed asks for the cluster's own variables: a Kubernetes indexed Job's
JOB_COMPLETION_INDEX gives the process id, and `jax.distributed.initialize()` finds the rest
(SLURM: SLURM_PROCID, SLURM_NTASKS, the first host of SLURM_STEP_NODELIST, one GPU per task
from SLURM_LOCALID; Open MPI alike). JAX_LOCAL_DEVICE_IDS restricts a process to those GPUs.
After initialization `jax.devices()` lists the devices of every process and the trainer's
mesh spans them all; each process reads its own share of the documents and feeds the rows of
its own devices.

A lost process (killed, crashed, its host gone) ends every other process within
--peer_timeout_s seconds, each with one line naming it (`train.runtime.peer_watch`); the
rerun resumes from the last committed checkpoint.
"""

import os

from absl import flags
from absl import logging
import jax

from train.runtime import peer_watch

# The process id a Kubernetes indexed Job gives each of its pods.
K8S_INDEX = "JOB_COMPLETION_INDEX"


def _env_int(name: str):
  value = os.environ.get(name)
  return int(value) if value not in (None, "") else None


flags.DEFINE_string("coordinator_address", os.environ.get("JAX_COORDINATOR_ADDRESS"),
                    "HOST:PORT of process 0 (several processes; env JAX_COORDINATOR_ADDRESS).")
flags.DEFINE_integer("num_processes", _env_int("JAX_NUM_PROCESSES"),
                     "Number of processes (env JAX_NUM_PROCESSES).")
flags.DEFINE_integer("process_id", _env_int("JAX_PROCESS_ID"),
                     "This process's id in [0, num_processes) (env JAX_PROCESS_ID).")
flags.DEFINE_bool("distributed", False,
                  "Initialize jax.distributed even with none of the three flags above, the "
                  "cluster giving what is unset (SLURM, Open MPI; a Kubernetes indexed Job's "
                  f"{K8S_INDEX} as the process id).")
flags.DEFINE_float("peer_timeout_s", 20.0,
                   "Several processes: a process silent this long is lost, and every other "
                   "one stops with a line naming it (0: leave it to JAX's own heartbeat "
                   "timeout, 100 s, which aborts with a stack trace).")
flags.register_validator("peer_timeout_s", lambda v: v == 0 or v > 1.0,
                         message="--peer_timeout_s must be 0 (off) or more than 1 s, the "
                         "interval of the watch's checks")

def initialize_args(coordinator_address, num_processes, process_id, distributed: bool,
                    env=None) -> dict | None:
  """`jax.distributed.initialize`'s arguments for these settings, or None for one process.
  With `distributed`, an unset process id comes from `env`'s (default: os.environ)
  Kubernetes index."""
  env = os.environ if env is None else env
  if distributed and process_id is None and env.get(K8S_INDEX, "") != "":
    process_id = int(env[K8S_INDEX])
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  if num_processes == 1 or not (distributed or any(v is not None for v in given.values())):
    return None
  return given


def initialize_from_flags() -> bool:
  """Joins the processes if the flags (or environment) say so and starts the watch for lost
  processes; returns whether it joined them.

  Must run before anything touches the devices.
  """
  f = flags.FLAGS
  args = initialize_args(f.coordinator_address, f.num_processes, f.process_id, f.distributed)
  if args is None:
    return False
  jax.distributed.initialize(**args)
  logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
  if f.peer_timeout_s > 0 and jax.process_count() > 1:
    # jax keeps its runtime client here; orbax reads it the same way.
    client = jax._src.distributed.global_state.client  # pylint: disable=protected-access
    peer_watch.start(client, jax.process_index(), jax.process_count(),
                     timeout_s=f.peer_timeout_s)
  return True

