"""Summarizes training speed and sparsity from finished or stopped runs.

  python -m train.throughput --workdirs=DIR1,DIR2 [--out=summary.json]

For each workdir it reads metrics.jsonl (written by train.main at every log
interval) and reports the median tokens/s over the logged intervals, leaving
out the first one (it includes compilation), and the sparsity of the last
logged step: active features per token and their fraction of H per layer.
Used for the sparse-vs-dense comparison of configs/small.py on a GPU:

  python -m train.main --config=configs/small.py --workdir=S ...
  python -m train.main --config=configs/small.py:dense --workdir=D ...
  python -m train.throughput --workdirs=S,D
"""

import json
import os

from absl import app
from absl import flags
import numpy as np

flags.DEFINE_list("workdirs", None, "Workdirs of the runs to summarize.")
flags.DEFINE_string("out", None, "Also write the JSON summary here.")
flags.mark_flag_as_required("workdirs")


def summarize(workdir: str) -> dict:
  """Speed and sparsity of one run (see module docstring)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if "tokens_per_s" in r]
  if not rows:
    raise ValueError(f"no training rows in {workdir}/metrics.jsonl")
  with open(os.path.join(workdir, "config.json")) as f:
    cfg = json.load(f)
  d_ff = cfg["model"]["d_ff"]
  last = rows[-1]
  n_layers = cfg["model"]["n_layers"]
  active = [last[f"active_per_token/layer_{i}"] for i in range(n_layers)]
  steady = [r["tokens_per_s"] for r in rows[1:]] or [rows[0]["tokens_per_s"]]
  return {
      "workdir": workdir,
      "ffn_implementation": cfg["model"]["ffn_implementation"] or "auto",
      "ffn_activation": cfg["model"]["ffn_activation"],
      "l1_coeff": cfg["l1_coeff"],
      "steps_logged": last["step"],
      "tokens_per_s_median": float(np.median(steady)),
      "loss_first": rows[0]["loss"], "loss_last": last["loss"],
      "active_per_token_last": active,
      "sparsity_last": [1.0 - a / d_ff for a in active],
      "mean_sparsity_last": float(1.0 - np.mean(active) / d_ff),
  }


def main(argv):
  del argv
  out = [summarize(w) for w in flags.FLAGS.workdirs]
  text = json.dumps(out, indent=1)
  print(text)
  if flags.FLAGS.out:
    with open(flags.FLAGS.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
