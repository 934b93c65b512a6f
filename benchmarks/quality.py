r"""Same quality for less GPU time? Held-out loss of the sparse model against the dense one.

    python -m benchmarks.quality --out=quality.json --plots=plots/          # one GPU
    python -m benchmarks.quality --smoke --out=/tmp/q.json --plots=/tmp/q   # CPU, a minute
    python -m benchmarks.quality --plot_only --out=quality.json --plots=plots/  # plots again

Every run is the training command a user types (`python -m train.main`, its own workdir,
no checkpoints), from the same initialisation (the config's seed) on the same token stream:
the offline corpus of Python sources (`--dataset`, held out by content) with a 32k
SentencePiece tokenizer trained on it offline (`train.corpus.build_tokenizer`, cached). Runs:

  dense_silu            the baseline: dense SiLU-gated FFN, no L1 (`configs/X.py:dense`)
  dense_relu            dense ReLU-gated FFN, no L1
  sparse_l1_<c>         ReLU + L1 at coefficient c (`--l1`), the default FFN choice (the
                        per-layer choice: sparse kernels where they pay)
  sparse_l1_<c>_reinit  the same with dead-gate re-initialisation (`--reinit_l1`)

on `--sweep_shape` (all of them) and `--best_shape` (dense SiLU and the sparse runs at
`--best_l1`). Two comparisons:

  * equal tokens: every run trains `--steps` steps of the same schedule; its held-out
    cross-entropy at the end (the trainer's eval on the validation split) over dense SiLU's;
  * equal wall-clock: each sparse run again, for the steps that fit in dense SiLU's measured
    wall-clock of the whole command (start-up and compiles included; the step count from
    its own equal-tokens run), with its own schedule over them.

Schedules: linear warm-up over the first tenth of a run's steps, then the config's cosine;
the paper shapes at 8 x 2048 tokens a step (`benchmarks.common.trained.SHORT_RUN`).

Every run starts with an empty compilation cache (its own), as a first run on a machine
does, so no run inherits another's compiles. Each equal-tokens run traces
`--profile_steps` steps near its end ("profile": the step's span and largest kernels).

Per run: steps, tokens, wall seconds of the command, final held-out CE, tokens/s (the
trainer's log), active features per token per layer and the dead fraction (last log),
peak device memory. Plots (PNG): held-out loss against wall-clock and against tokens, one
line per run and shape; final loss and speed-up against L1. JSON (`--out`, written after
every run; a rerun with the same `--out` skips the runs it holds):
`{"device", "corpus", "tokenizer", "runs": [...], "best": {"shape", "l1",
"ce_ratio_equal_tokens", "ce_ratio_equal_time"}}`, "best" the `--best_shape` sparse run
with the lowest equal-time ratio.
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags

from benchmarks.common import cli_run


def _define_flags():
  flags.DEFINE_string("out", None, "results JSON (read first: its runs are skipped)")
  flags.DEFINE_string("plots", None, "folder for the PNG plots")
  flags.DEFINE_string("workdir", "/tmp/twell_quality", "where the runs' workdirs go")
  flags.DEFINE_bool("smoke", False, "CPU smoke mode: tiny shape, byte tokenizer, a few steps")
  flags.DEFINE_string("sweep_shape", "small", "config of the L1 sweep")
  flags.DEFINE_string("best_shape", "paper_0p5b", "config of the dense-vs-best comparison "
                      "('' to skip)")
  flags.DEFINE_list("l1", ["1e-5", "2e-5", "3e-5", "5e-5"], "L1 coefficients of the sweep")
  flags.DEFINE_list("reinit_l1", ["2e-5"], "L1 coefficients also run with dead-gate reinit")
  flags.DEFINE_list("best_l1", ["2e-5", "3e-5"], "L1 coefficients at --best_shape")
  flags.DEFINE_integer("steps", 1000, "steps of every equal-tokens run")
  flags.DEFINE_integer("batch_size", None, "sequences per step (default: the config's)")
  flags.DEFINE_integer("seq_len", None, "context (default: the config's)")
  flags.DEFINE_integer("eval_points", 10, "held-out evaluations per run")
  flags.DEFINE_integer("eval_batches", 16, "batches per held-out evaluation")
  flags.DEFINE_string("dataset", cli_run.DEFAULT_DATASET, "offline corpus")
  flags.DEFINE_string("tokenizer", cli_run.DEFAULT_TOKENIZER, "SentencePiece model path without "
                      ".model (trained offline if missing), or 'byte'")
  flags.DEFINE_list("runs", None, "only these run names (default: all)")
  flags.DEFINE_integer("timeout", 3600, "seconds per run")
  flags.DEFINE_bool("plot_only", False, "only draw --plots from the runs --out holds")
  flags.DEFINE_integer("profile_steps", 3, "equal-tokens runs: steps traced near the end "
                       "(the step's largest kernels in the JSON; 0: none)")


def run_specs(fl) -> list[dict]:
  """The runs, each {"name", "shape", "l1", "reinit", "flags"} (model flags only)."""
  relu = ["--config.model.ffn_activation=relu"]
  specs = []

  def add(shape, l1s, reinit_l1s):
    specs.append({"name": f"{shape}/dense_silu", "shape": shape, "l1": 0.0, "reinit": False,
                  "variant": "dense", "flags": []})
    if shape == fl.sweep_shape:
      specs.append({"name": f"{shape}/dense_relu", "shape": shape, "l1": 0.0, "reinit": False,
                    "variant": None, "flags": relu + ["--config.model.ffn_implementation=dense",
                                                       "--config.l1_coeff=0"]})
    for c in l1s:
      for reinit in (False, True) if c in reinit_l1s else (False,):
        specs.append({
            "name": f"{shape}/sparse_l1_{c}" + ("_reinit" if reinit else ""), "shape": shape,
            "l1": float(c), "reinit": reinit, "variant": None,
            "flags": relu + [f"--config.l1_coeff={c}"]
                     + (["--config.dead_reinit=True"] if reinit else [])})

  add(fl.sweep_shape, fl.l1, fl.reinit_l1)
  if fl.best_shape and fl.best_shape != fl.sweep_shape:
    add(fl.best_shape, fl.best_l1, [])
  if fl.runs:
    specs = [s for s in specs if s["name"] in fl.runs or s["name"].split("/")[1] in fl.runs]
  return specs


def _schedule_flags(shape: str, steps: int) -> list[str]:
  """Warm-up over the first tenth of each run's own steps; the paper shapes at
  `benchmarks.common.trained.SHORT_RUN`'s batch and rate (their configs are for 50k-step runs)."""
  warmup = max(1, steps // 10)
  if shape.startswith("paper_"):
    from benchmarks.common import trained  # pylint: disable=import-outside-toplevel
    return trained.short_run_flags(warmup)
  return [f"--config.warmup_steps={warmup}"]


def train_run(fl, spec: dict, steps: int, data_flags: list[str], tag: str) -> dict:
  """One `train.main` command; its measurements (module docstring)."""
  from train.runtime import metrics  # pylint: disable=import-outside-toplevel
  workdir = os.path.join(fl.workdir, spec["name"].replace("/", "_") + tag)
  config = f"configs/{spec['shape']}.py" + (f":{spec['variant']}" if spec["variant"] else "")
  every = max(1, steps // fl.eval_points)
  cmd = cli_run.command(workdir, config, [
      f"--config.num_train_steps={steps}", f"--config.eval_every={every}",
      f"--config.eval_batches={fl.eval_batches}", f"--config.log_every={every}",
      "--config.checkpoint_every=0", *_schedule_flags(spec["shape"], steps), *data_flags,
      *spec["flags"]])
  profile = fl.profile_steps if not tag and steps > fl.profile_steps + 10 else 0
  if profile:   # away from the evaluations (every `every` steps) and the last step
    cmd += [f"--config.profile.first_step={steps - profile - 5}",
            f"--config.profile.steps={profile}"]
  if fl.batch_size:
    cmd.append(f"--config.batch_size={fl.batch_size}")
  if fl.seq_len:
    cmd.append(f"--config.data.seq_len={fl.seq_len}")
  proc, t0 = cli_run.start(cmd, workdir + ".log")
  wall = cli_run.finish(proc, t0, fl.timeout, spec["name"])
  rows = metrics.read_jsonl(workdir)
  evals = [r for r in rows if "eval/loss" in r]
  train_rows = [r for r in rows if "loss" in r and "eval/loss" not in r]
  last = train_rows[-1]
  layers = sorted(int(k.rsplit("_", 1)[1]) for k in last if k.startswith("active_per_token/"))
  from train.config import workdir as workdir_config
  run_cfg = workdir_config.read_workdir_config(workdir)   # the config the run trained with
  tokens_per_step = run_cfg["batch_size"] * run_cfg["data"]["seq_len"]
  from benchmarks.common import timing  # pylint: disable=import-outside-toplevel
  traced = timing.trace_breakdown(os.path.join(workdir, "profile"), profile) if profile else None
  return {
      "profile": traced and {"span_ms": traced["span_ms"], "kernels": traced["kernels"][:8]},
      "name": spec["name"] + tag, "shape": spec["shape"], "l1": spec["l1"],
      "reinit": spec["reinit"], "steps": steps, "tokens": steps * tokens_per_step,
      "wall_s": wall, "final_ce": evals[-1]["eval/loss"],
      "tokens_per_s": last.get("tokens_per_s"),
      "active_per_token": [last[f"active_per_token/layer_{l}"] for l in layers],
      "dead_fraction": [last.get(f"dead_fraction/layer_{l}") for l in layers],
      "peak_memory_gib": max((r["peak_memory_gib"] for r in rows if "peak_memory_gib" in r),
                             default=None),
      "curve": [{"step": r["step"], "tokens": r["step"] * tokens_per_step,
                 "seconds": r["wall_time"] - t0, "ce": r["eval/loss"]} for r in evals],
      # Start-up and compiles: the command's time before its first logged step.
      "first_step_s": train_rows[0]["wall_time"] - t0,
  }


def steps_in(run: dict, wall_s: float) -> int:
  """Steps of `run`'s command that fit in `wall_s` seconds: its start-up, then its measured
  seconds per step (evaluations included, at the same cadence)."""
  per_step = (run["wall_s"] - run["first_step_s"]) / run["steps"]
  return max(1, int((wall_s - run["first_step_s"]) / per_step))


def summarize(results: dict, best_shape: str) -> None:
  """Ratios to each shape's dense SiLU run, and "best" (module docstring)."""
  runs = results["runs"]
  base = {r["shape"]: r for r in runs if r["name"] == f"{r['shape']}/dense_silu"}
  for r in runs:
    b = base.get(r["shape"])
    if b is not None:
      r["ce_ratio"] = r["final_ce"] / b["final_ce"]
      r["wall_ratio"] = r["wall_s"] / b["wall_s"]
  best = None
  for r in runs:
    if r["shape"] != best_shape or not r["name"].endswith("_equal_time"):
      continue
    tokens_run = next((x for x in runs if x["name"] == r["name"][:-len("_equal_time")]), None)
    if tokens_run is None or "ce_ratio" not in r:
      continue
    cand = {"shape": r["shape"], "l1": r["l1"], "reinit": r["reinit"],
            "ce_ratio_equal_tokens": tokens_run["ce_ratio"],
            "ce_ratio_equal_time": r["ce_ratio"]}
    if best is None or cand["ce_ratio_equal_time"] < best["ce_ratio_equal_time"]:
      best = cand
  results["best"] = best


def plot(results: dict, out_dir: str) -> list[str]:
  """The PNGs of the module docstring; returns their paths."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  os.makedirs(out_dir, exist_ok=True)
  written = []
  shapes = sorted({r["shape"] for r in results["runs"]})
  for x_key, label in (("seconds", "wall-clock of the command (s)"), ("tokens", "tokens")):
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
      for r in results["runs"]:
        if r["shape"] == shape and r["curve"]:
          style = "--" if r["name"].endswith("_equal_time") else "-"
          ax.plot([p[x_key] for p in r["curve"]], [p["ce"] for p in r["curve"]], style,
                  marker="o", markersize=3, label=r["name"].split("/", 1)[1])
      ax.set_title(f"{shape}: held-out cross-entropy")
      ax.set_xlabel(label)
      ax.set_ylabel("held-out CE (nats/token)")
      ax.legend(fontsize=7)
    path = os.path.join(out_dir, f"quality_vs_{x_key}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  sweep = [r for r in results["runs"] if r["l1"] > 0 and not r["reinit"]
           and "ce_ratio" in r and not r["name"].endswith("_equal_time")]
  if sweep:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for shape in shapes:
      pts = sorted((r["l1"], r["ce_ratio"], 1 / r["wall_ratio"]) for r in sweep
                   if r["shape"] == shape)
      if pts:
        l1s, ce, speed = zip(*pts)
        ax.plot(l1s, ce, "o-", label=f"{shape}: CE / dense SiLU's (equal tokens)")
        ax.plot(l1s, speed, "s--", label=f"{shape}: speed-up of the whole command")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("L1 coefficient")
    ax.set_title("trade-off: final loss and speed against L1")
    ax.legend(fontsize=7)
    path = os.path.join(out_dir, "quality_tradeoff.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written


def main(argv):
  del argv
  fl = flags.FLAGS
  if fl.smoke:
    fl.sweep_shape, fl.best_shape, fl.l1, fl.reinit_l1, fl.best_l1 = "tiny", "", ["1e-3"], [], []
    fl.steps, fl.eval_points, fl.eval_batches = min(fl.steps, 6), 2, 2
    fl.dataset, fl.tokenizer = "twell_stdlib_text", "byte"
    fl.runs = fl.runs or ["dense_silu", "sparse_l1_1e-3"]
  from train.corpus import text_corpus  # pylint: disable=import-outside-toplevel
  results = {"runs": []}
  if fl.out and os.path.exists(fl.out):
    with open(fl.out) as f:
      results = json.load(f)
  done = {r["name"] for r in results["runs"]}
  if fl.plot_only:
    for path in plot(results, fl.plots):
      print(f"  plot: {path}")
    return
  results["corpus"] = {**text_corpus.fingerprint(fl.dataset, "train"),
                       "validation": text_corpus.fingerprint(fl.dataset, "validation")}
  tokenizer = cli_run.tokenizer_record(fl.tokenizer, fl.dataset)
  results["tokenizer"] = tokenizer or {"model": "byte"}
  results["device"] = cli_run.device_name()
  data_flags = cli_run.data_flags(fl.dataset, tokenizer)

  def save():
    summarize(results, fl.best_shape or fl.sweep_shape)
    if fl.out:
      with open(fl.out, "w") as f:
        json.dump(results, f, indent=1)

  specs = run_specs(fl)
  for spec in specs:                                        # equal tokens
    if spec["name"] not in done:
      r = train_run(fl, spec, fl.steps, data_flags, "")
      results["runs"].append(r)
      save()
      print(f"  {r['name']:<36} {r['steps']:>6} steps {r['wall_s']:7.1f} s  held-out CE "
            f"{r['final_ce']:.4f}  {r['tokens_per_s'] or 0:,.0f} tok/s", flush=True)
  by_name = {r["name"]: r for r in results["runs"]}
  for spec in specs:                                        # equal wall-clock
    base = by_name.get(f"{spec['shape']}/dense_silu")
    own = by_name.get(spec["name"])
    name = spec["name"] + "_equal_time"
    if spec["l1"] == 0 or base is None or own is None or name in by_name:
      continue
    steps = steps_in(own, base["wall_s"])
    r = train_run(fl, spec, steps, data_flags, "_equal_time")
    results["runs"].append(r)
    by_name[name] = r
    save()
    print(f"  {r['name']:<36} {r['steps']:>6} steps {r['wall_s']:7.1f} s (dense SiLU "
          f"{base['wall_s']:.1f} s)  held-out CE {r['final_ce']:.4f}", flush=True)
  save()
  if fl.plots:
    for path in plot(results, fl.plots):
      print(f"  plot: {path}")
  if results.get("best"):
    print(f"best: {json.dumps(results['best'])}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
