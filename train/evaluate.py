"""Evaluates a checkpoint: python -m train.evaluate --workdir=D [--step=N].

Opens D/checkpoints read-only, restores only the parameters of step N (default:
the latest), rebuilds the model from the config saved with that checkpoint (on
the run's mesh if it fits the devices here, else data parallel over all of them),
and reports held-out cross-entropy, perplexity and per-layer sparsity of the
eval split as JSON on stdout; the same JSON goes to D/eval_step_<N>.json.
"""

import json
import os

from absl import flags
import jax

from train import cli
from train.inference import loading

flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
flags.DEFINE_integer("eval_batches", None,
                     "Number of eval batches (default: the config's).")
flags.DEFINE_string("data_dir", None,
                    "Override the config's TFDS data_dir (data moved).")
flags.mark_flag_as_required("workdir")


def main():
  f = flags.FLAGS
  result = loading.evaluate_checkpoint(f.workdir, f.step, f.eval_batches, f.data_dir)
  text = json.dumps(result, indent=1)
  print(text)
  if jax.process_index() == 0:
    with open(os.path.join(f.workdir, f"eval_step_{result['step']}.json"),
              "w") as fh:
      fh.write(text + "\n")


if __name__ == "__main__":
  cli.run(main)
