"""Trains a sparse (TwELL) LM: python -m train.main --config=C --workdir=D.

Override config values with --config.<field>=<value>. Rerunning the same
command on the same workdir resumes from its latest checkpoint; SIGTERM stops
after the current step with a checkpoint (exit status 143). Several processes (one per
host or per GPU): the same command in each, with --coordinator_address, --num_processes and
--process_id (train/runtime/distributed.py; on one machine `python -m train.launch` starts
them; docs/cluster.md).
"""

import signal

from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from train import cli
from train.runtime import distributed
from train.training import loop

config_flags.DEFINE_config_file("config", None, "Training config file.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
flags.DEFINE_bool("accept_config_change", False,
                  "Resume although the config changes the optimisation of the run (number "
                  "of steps, schedule, optimizer, L1): fields whose change the checkpoints "
                  "fit. Changes of the model or the data stream are refused regardless.")
flags.DEFINE_bool("allow_fresh_start", False,
                  "Train from step 0 although every earlier checkpoint of this workdir "
                  "was moved to corrupt_checkpoints/ as damaged.")
flags.mark_flags_as_required(["config", "workdir"])


def main():
  distributed.initialize_from_flags()
  logging.info("jax %s, process %d/%d, devices %s", jax.__version__,
               jax.process_index(), jax.process_count(), jax.devices())
  f = flags.FLAGS
  loop.train_and_evaluate(f.config, f.workdir, accept_config_change=f.accept_config_change,
                          allow_fresh_start=f.allow_fresh_start)
  # Every step ran and the last checkpoint is committed: a SIGTERM during the exit (JAX's
  # teardown takes a moment, after Python has put back the default handlers, which would end
  # the process as killed) must not report the finished run as killed. Ignored, not handled:
  # an ignored signal stays ignored through the interpreter's finalization.
  signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
  cli.run(main)
