r"""The sparsity report of a run (`python -m train.report`, whose docstring lists the plots
and the summary): `make_report(workdir, out_dir, step=..., max_tokens=...)`."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from train.inference import loading
from train.runtime import metrics
from train.models import transformer as model_lib


_PLOT_ROWS = {"active_per_token": "active features per token",
              "dead_fraction": "dead-feature fraction"}


def eval_activity(ck: loading.Checkpoint, max_tokens: int = 16384):
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
  params = loading.inference_params(ck.params, mc)
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
  ck = loading.load_checkpoint(workdir, step, data_dir=data_dir)
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
