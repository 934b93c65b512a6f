"""Several processes, one per host, joined into one JAX system (`jax.distributed`).

Every process runs the same command; they differ only in their process id:

  --coordinator_address=HOST:PORT   process 0's address, reachable from every host
  --num_processes=N                 how many processes (hosts)
  --process_id=I                    this process's id, 0 <= I < N

Each defaults to the environment's JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID. With none of them set, a single process runs, unless --distributed asks
`jax.distributed.initialize()` to find them from the cluster (SLURM, Open MPI, Kubernetes;
there JAX gives each process one GPU unless JAX_LOCAL_DEVICE_IDS lists several).
After initialization `jax.devices()` lists the devices of every process and the trainer's
mesh spans them all; each process reads its own share of the documents and feeds the rows of
its own devices.
"""

import os

from absl import flags
from absl import logging
import jax


def _env_int(name: str):
  value = os.environ.get(name)
  return int(value) if value not in (None, "") else None


flags.DEFINE_string("coordinator_address", os.environ.get("JAX_COORDINATOR_ADDRESS"),
                    "HOST:PORT of process 0 (several processes; env JAX_COORDINATOR_ADDRESS).")
flags.DEFINE_integer("num_processes", _env_int("JAX_NUM_PROCESSES"),
                     "Number of processes, one per host (env JAX_NUM_PROCESSES).")
flags.DEFINE_integer("process_id", _env_int("JAX_PROCESS_ID"),
                     "This process's id in [0, num_processes) (env JAX_PROCESS_ID).")
flags.DEFINE_bool("distributed", False,
                  "Initialize jax.distributed even with none of the three flags above, the "
                  "cluster (SLURM, Open MPI, Kubernetes) giving what is unset.")


def initialize_args(coordinator_address, num_processes, process_id,
                    distributed: bool) -> dict | None:
  """`jax.distributed.initialize`'s arguments for these settings, or None for one process."""
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  if num_processes == 1 or not (distributed or any(v is not None for v in given.values())):
    return None
  return given


def initialize_from_flags() -> bool:
  """Joins the processes if the flags (or environment) say so; returns whether it did.

  Must run before anything touches the devices.
  """
  f = flags.FLAGS
  args = initialize_args(f.coordinator_address, f.num_processes, f.process_id, f.distributed)
  if args is None:
    return False
  jax.distributed.initialize(**args)
  logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
  return True
