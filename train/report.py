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
step, beside the per-layer scalars the trainer logs there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np

from train import checkpointing
from train import inference
from train import metrics
from train import model as model_lib
from train import train_lib

_PLOT_ROWS = {"active_per_token": "active features per token",
              "dead_fraction": "dead-feature fraction"}


def eval_activity(ck: inference.Checkpoint, max_tokens: int = 16384):
  """(fire counts per feature [L, H], active features per token [L, M], each layer's
  `activity_stats`, M tokens) of the first eval batch, cut to at most `max_tokens` tokens."""
  from twell_jax import dense as dense_lib  # pylint: disable=import-outside-toplevel
  from twell_jax import testing as twell_testing  # pylint: disable=import-outside-toplevel
  cfg, mc = ck.config, ck.model_cfg
  cfg.eval_batches = 1
  batch = ck.trainer.eval_batches()[0]
  rows = max(1, min(batch.shape[0], max_tokens // cfg.data.seq_len))
  tokens = jax.numpy.asarray(batch[:rows, :-1])
  lm = model_lib.LanguageModel(dataclasses.replace(mc, scan_layers=True, remat=False))
  params = inference.inference_params(ck.params, mc)
  inputs = jax.jit(lm.ffn_inputs)(params, tokens)                  # [L, B, T, D]
  ffn = params["blocks"]["ffn"]
  mask_fn = jax.jit(lambda x, wg, wu: dense_lib.activity_mask(
      x.reshape(-1, x.shape[-1]), wg, wu, mc.ffn_activation))
  per_feature, per_row, stats = [], [], []
  for l in range(mc.n_layers):
    wg = ffn["w_gate"][l] if "w_gate" in ffn else None
    mask = np.asarray(mask_fn(inputs[l], wg, ffn["w_up"][l]))    # [M, H] bool
    per_feature.append(mask.sum(axis=0))
    per_row.append(mask.sum(axis=1))
    stats.append(twell_testing.activity_stats(mask))
  return np.stack(per_feature), np.stack(per_row), stats, int(tokens.size)


def _layer_colors(plt, n: int):
  return plt.get_cmap("viridis")(np.linspace(0.0, 0.9, max(n, 1)))


def _series(rows, key):
  pts = [(r["step"], r[key]) for r in rows if key in r]
  return [p[0] for p in pts], [p[1] for p in pts]


def _plot_training(plt, rows, n_layers: int, out_dir: str) -> list[str]:
  written = []
  colors = _layer_colors(plt, n_layers)
  for name, label in _PLOT_ROWS.items():
    if not any(f"{name}/layer_0" in r for r in rows):
      continue
    fig, ax = plt.subplots(figsize=(7, 4))
    for l in range(n_layers):
      ax.plot(*_series(rows, f"{name}/layer_{l}"), color=colors[l], label=f"layer {l}")
      steps, vals = _series(rows, f"eval/{name}/layer_{l}")
      if steps:
        ax.plot(steps, vals, "--o", color=colors[l], markersize=3)
    ax.set_xlabel("training step")
    ax.set_ylabel(label)
    ax.set_title(f"{label} per layer" + (" (dashed: held-out eval)"
                                         if name == "active_per_token" else ""))
    ax.legend(fontsize=7, ncol=2 if n_layers > 8 else 1)
    written.append(_save(fig, plt, out_dir, f"{name}.png"))
  for name, keys in (("loss", ("loss", "cross_entropy", "eval/loss")),
                     ("tokens_per_s", ("tokens_per_s",))):
    if not any(keys[0] in r for r in rows):
      continue
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
      steps, vals = _series(rows, key)
      if steps:
        ax.plot(steps, vals, "o-" if key.startswith("eval/") else "-", label=key,
                markersize=3)
    ax.set_xlabel("training step")
    ax.set_ylabel("tokens/s" if name == "tokens_per_s" else "nats per token")
    ax.legend(fontsize=8)
    written.append(_save(fig, plt, out_dir, f"{name}.png"))
  return written


def _plot_batch(plt, per_feature, per_row, n_tokens_rows: int, d_ff: int,
                out_dir: str) -> list[str]:
  n_layers = per_feature.shape[0]
  colors = _layer_colors(plt, n_layers)
  fig, ax = plt.subplots(figsize=(7, 4))
  ranks = np.arange(1, d_ff + 1)
  for l in range(n_layers):
    rate = np.sort(per_feature[l])[::-1] / n_tokens_rows
    alive = rate > 0
    ax.plot(ranks[alive], rate[alive], color=colors[l],
            label=f"layer {l} ({int(np.sum(~alive))} never fired)")
  ax.set_yscale("log")
  ax.set_xlabel(f"feature rank (of {d_ff}, most popular first)")
  ax.set_ylabel("share of tokens it fires on")
  ax.set_title("feature popularity (one eval batch)")
  ax.legend(fontsize=7)
  written = [_save(fig, plt, out_dir, "feature_popularity.png")]

  cols = min(4, n_layers)
  nrows = -(-n_layers // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows), squeeze=False)
  for l in range(nrows * cols):
    ax = axes[l // cols][l % cols]
    if l >= n_layers:
      ax.axis("off")
      continue
    ax.hist(per_row[l], bins=40, color=colors[l])
    ax.axvline(float(np.mean(per_row[l])), color="k", linewidth=1)
    ax.set_title(f"layer {l}: mean {np.mean(per_row[l]):.1f}", fontsize=9)
    ax.set_xlabel("active features per token", fontsize=8)
  fig.suptitle("row lengths (one eval batch)")
  written.append(_save(fig, plt, out_dir, "row_length_hist.png"))
  return written


def _save(fig, plt, out_dir: str, name: str) -> str:
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, name), dpi=110)
  plt.close(fig)
  return name


def _training_summary(rows, n_layers: int) -> dict | None:
  keys = [f"active_per_token/layer_{l}" for l in range(n_layers)]
  train_rows = [r for r in rows if all(k in r for k in keys)]
  if not train_rows:
    return None
  first, last = train_rows[0], train_rows[-1]
  speeds = [r["tokens_per_s"] for r in train_rows[1:] if "tokens_per_s" in r]
  return {
      "steps_logged": len(train_rows),
      "first": {"step": first["step"], "active_per_token": [first[k] for k in keys],
                "loss": first.get("loss")},
      "last": {"step": last["step"], "active_per_token": [last[k] for k in keys],
               "loss": last.get("loss"),
               "dead_fraction": [last.get(f"dead_fraction/layer_{l}")
                                 for l in range(n_layers)]},
      # The first interval includes compilation.
      "tokens_per_s_median": float(np.median(speeds)) if speeds else None,
  }


def make_report(workdir: str, out_dir: str | None = None, *, step: int | None = None,
                max_tokens: int = 16384, data_dir: str | None = None) -> dict:
  """Writes the plots and summary.json into `out_dir` (default W/report); returns the
  summary (see the module docstring)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  ck = inference.load_checkpoint(workdir, step, data_dir=data_dir)
  mc = ck.model_cfg
  out_dir = out_dir or os.path.join(workdir, "report")
  os.makedirs(out_dir, exist_ok=True)
  rows = metrics.read_jsonl(workdir)
  plots = _plot_training(plt, rows, mc.n_layers, out_dir)
  per_feature, per_row, stats, n_tokens = eval_activity(ck, max_tokens)
  plots += _plot_batch(plt, per_feature, per_row, n_tokens, mc.d_ff, out_dir)
  if jax.process_index() == 0:
    writer = metrics.MetricWriter(workdir)
    try:
      writer.write_histograms(ck.step, {
          **{f"report/row_length/layer_{l}": per_row[l] for l in range(mc.n_layers)},
          **{f"report/feature_rate/layer_{l}": per_feature[l] / n_tokens
             for l in range(mc.n_layers)}})
    finally:
      writer.close()
  summary = {
      "workdir": os.path.abspath(workdir), "step": ck.step, "n_layers": mc.n_layers,
      "d_ff": mc.d_ff, "ffn_activation": mc.ffn_activation,
      "l1_coeff": float(ck.config.l1_coeff),
      "eval_batch": {"tokens": n_tokens, "layers": stats},
      "training": _training_summary(rows, mc.n_layers),
      "plots": plots,
  }
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "Training workdir (checkpoints/, metrics.jsonl).")
  flags.DEFINE_string("out", None, "Report directory (default: WORKDIR/report).")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_integer("max_tokens", 16384, "Tokens of the eval batch to analyse at most.")
  flags.DEFINE_string("data_dir", None, "Override the config's TFDS data_dir (data moved).")
  flags.mark_flag_as_required("workdir")


def main(argv):
  from absl import app  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  from absl import logging  # pylint: disable=import-outside-toplevel
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  metrics.quiet_library_logs()
  f = flags.FLAGS
  try:
    summary = make_report(f.workdir, f.out, step=f.step, max_tokens=f.max_tokens,
                          data_dir=f.data_dir)
  except (checkpointing.CheckpointError, train_lib.ConfigError) as e:
    logging.error("%s", e)
    sys.exit(f"error: {e}")
  out = f.out or os.path.join(f.workdir, "report")
  act = [s["active_per_token"] for s in summary["eval_batch"]["layers"]]
  print(f"step {summary['step']}: active features per token per layer "
        f"{' '.join(f'{a:.1f}' for a in act)} of {summary['d_ff']}; wrote "
        f"{', '.join(summary['plots'])} and summary.json to {out}")


if __name__ == "__main__":
  from absl import app as _app  # pylint: disable=g-import-not-at-top
  _define_flags()
  jax.config.config_with_absl()
  _app.run(main)
