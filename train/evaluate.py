"""Evaluates a checkpoint: python -m train.evaluate --workdir=D [--step=N].

Opens D/checkpoints read-only, restores only the parameters of step N (default:
the latest), rebuilds the model from the config saved with that checkpoint (on
the run's mesh if it fits the devices here, else data parallel over all of them),
and reports held-out cross-entropy, perplexity and per-layer sparsity of the
eval split as JSON on stdout; the same JSON goes to D/eval_step_<N>.json.
"""

import json
import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax

from train import checkpointing
from train import inference
from train import metrics
from train import train_lib

flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
flags.DEFINE_integer("eval_batches", None,
                     "Number of eval batches (default: the config's).")
flags.DEFINE_string("data_dir", None,
                    "Override the config's TFDS data_dir (data moved).")
flags.mark_flag_as_required("workdir")


def evaluate_checkpoint(workdir: str, step: int | None = None,
                        eval_batches: int | None = None,
                        data_dir: str | None = None) -> dict:
  """Returns the eval JSON dict for a checkpoint (see module docstring)."""
  ck = inference.load_checkpoint(workdir, step, data_dir=data_dir)
  if eval_batches:
    ck.config.eval_batches = eval_batches
  result = ck.trainer.evaluate(ck.params, ck.trainer.eval_batches())
  return {"step": ck.step, "workdir": os.path.abspath(workdir),
          "eval_split": ck.config.data.eval_split, **result}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  metrics.quiet_library_logs()
  f = flags.FLAGS
  try:
    result = evaluate_checkpoint(f.workdir, f.step, f.eval_batches,
                                 f.data_dir)
  except (checkpointing.CheckpointError, train_lib.ConfigError) as e:
    logging.error("%s", e)
    sys.exit(f"error: {e}")
  text = json.dumps(result, indent=1)
  print(text)
  if jax.process_index() == 0:
    with open(os.path.join(f.workdir, f"eval_step_{result['step']}.json"),
              "w") as fh:
      fh.write(text + "\n")


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main)
