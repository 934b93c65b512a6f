r"""Sparsity report of a run: PNG plots and a JSON summary.

  python -m train.report --workdir=W [--out=W/report] [--step=N] [--max_tokens=16384]

From the run's logs (W/metrics.jsonl, one row per logged interval and eval):
  active_per_token.png    active FFN features per token of each layer over the training
                          steps (dashed: the held-out evals)
  dead_fraction.png       each layer's fraction of features that have not fired within
                          dead_window_tokens, over the steps
  loss.png                training loss and cross-entropy (and the held-out loss)
  tokens_per_s.png        training throughput over the steps
From one evaluation batch of the checkpoint (default: the latest), with the exact activity
pattern of the dense FFN (`twell_jax.dense.activity_mask`) on each layer's input:
  feature_popularity.png  per layer, the share of the batch's tokens each feature fires on,
                          features sorted from the most to the least popular (log scale): a
                          flat curve is uniform use, a steep head a few hot features, the
                          drop to nothing the dead ones
  row_length_hist.png     per layer, the histogram of active features per token (the row
                          lengths the sparse layouts store)
summary.json: the checkpoint's per-layer statistics (`twell_jax.testing.activity_stats`:
active per token, dead fraction, share of the top 1% / 10% of features, row-length
percentiles), the first and last logged training activity, tokens/s and loss.

The same batch's per-layer row lengths and feature firing rates go to W/tensorboard as
histograms (`report/row_length/layer_l`, `report/feature_rate/layer_l`) at the checkpoint's
step, beside the per-layer scalars the trainer logs there. The library:
`train.inference.report`.
"""

import os

from train import cli
from train.inference import report


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "Training workdir (checkpoints/, metrics.jsonl).")
  flags.DEFINE_string("out", None, "Report directory (default: WORKDIR/report).")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_integer("max_tokens", 16384, "Tokens of the eval batch to analyse at most.")
  flags.DEFINE_string("data_dir", None, "Override the config's TFDS data_dir (data moved).")
  flags.mark_flag_as_required("workdir")


def main():
  from absl import flags  # pylint: disable=import-outside-toplevel
  f = flags.FLAGS
  summary = report.make_report(f.workdir, f.out, step=f.step, max_tokens=f.max_tokens,
                               data_dir=f.data_dir)
  out = f.out or os.path.join(f.workdir, "report")
  act = [s["active_per_token"] for s in summary["eval_batch"]["layers"]]
  print(f"step {summary['step']}: active features per token per layer "
        f"{' '.join(f'{a:.1f}' for a in act)} of {summary['d_ff']}; wrote "
        f"{', '.join(summary['plots'])} and summary.json to {out}")


if __name__ == "__main__":
  cli.run(main, _define_flags)
