r"""Same quality, sooner? Time to the dense model's held-out loss, over seeds.

    python -m benchmarks.time_to_quality --seeds=0,1,2,3,4 \
        --out=benchmarks/results/h200/time_to_quality.json --plot=time_to_quality.png   # GPU
    python -m benchmarks.time_to_quality --smoke --seeds=0 --out=/tmp/t.json           # CPU

For each seed, three whole runs, each the command a user types (`benchmarks.whole_run`'s
setup: paper 0.5B, 8 x 2048 tokens a step, the offline corpus of Python sources held out by
content, its 32k tokenizer, an empty compilation cache), one after the other on one GPU:

  dense     dense SiLU FFN for `--steps` steps (the baseline)
  sparse    ReLU + L1 for the same steps
  sparse_t  ReLU + L1 for dense's wall-clock: its step count is `--steps` plus what fits
            in the seconds dense took beyond sparse, at sparse's settled speed (the median
            tokens/s of its last five logged intervals) and counting the held-out
            evaluations the extra steps add, on its own cosine schedule over those steps
            (or `--equal_time_steps`: a lever screened at equal time alone)

Held-out cross-entropy every `--eval_every` steps and at the end, on `--eval_batches` batches
of the held-out split (64 x 16384 tokens = 1M by default) with its standard error over the
batches. Per seed, all three done: the whole-run ratio (dense's wall-clock over sparse's), the
CE ratio at equal steps (sparse's over dense's), the CE ratio at equal wall-clock (sparse_t's
over dense's; sparse_t's wall-clock over dense's is recorded beside it), and the time the
sparse model takes to reach dense's final CE, as dense's wall-clock over it:

  Time to dense CE is read off the two sparse runs, both ended on their schedule, CE taken as
  a power of wall-clock, CE(t) = c t^-a. Where dense's CE lies between the two runs' CEs, t*
  is interpolated between their (wall, CE) points on that law (the seed's own slope: no
  extrapolation). Otherwise it is extrapolated from the run whose CE is nearer dense's with
  `a` pooled over the seeds (the mean of their slopes: one seed's two points sit ~25% apart in
  time, where one run's CE moves ~1.5%, so a per-seed slope is mostly noise), so that t* never
  contradicts a run: before the shorter run's end where it ended below dense's CE, past the
  longer one's where both ended above. With no pooled slope (CE did not fall with time) only
  the interpolation is made. Beside it, with no model, a lower bound: dense's wall-clock over
  that of the shorter sparse run that ended at or below dense's CE
  (`time_to_dense_ce_ratio_at_least`).

The CE ratios' standard errors from the held-out batches alone (paired: every run is
evaluated on the same batches) are recorded per seed beside them, to set the evaluation's own
noise against the spread over seeds.

Summary: each ratio's mean over seeds with a 95% interval (Student t over the seeds; none
for one seed). The corpus's size is recorded (documents, bytes; tokens estimated from dense's
run: the tokens it trained on over the passes over the corpus it made), with each run's
passes.

`--merge=a.json,b.json` adds the runs of other results files (the same setting) to `--out`
and runs nothing: commands run side by side, on one machine's GPUs or on several machines.

Runs go one after the other on one GPU, or with `--gpus=0,1,...` as many at once as GPUs
named, each alone on its GPU (a run takes the first free GPU, `--stagger_s` after the last
start; a seed's sparse_t waits for its dense and sparse); each run records its "gpu" and the
GPUs on its host ("host_gpus": runs of other commands may share the host's CPUs). A time
limit per command: `--out` is read first and its finished runs are kept, so the same command,
repeated, carries on where the last stopped; `--budget_s` starts no run
that the runs already timed predict would end past that many seconds. JSON (`--out`):
{"device", "seeds", "steps", "corpus", "summary": {"wall_ratio", "ce_ratio_equal_steps",
"ce_ratio_equal_time", "time_to_dense_ce_ratio"} each {"mean", "ci95": [low, high], "n"},
with "time_to_dense_ce_ratio_at_least" and the dense runs' own spread over seeds as
"dense_ce" and "dense_wall_s"), "slope", "phases" (dense's and sparse's wall-clock cut at the
first step and the evaluations, `whole_run.phases`, each part's mean over seeds),
"per_seed": [...], "codes", "runs": [whole_run's record + "seed", "arm", "code", "gpu",
"host_gpus", "started_at"]}. A run's
"code" is the digest of the code it ran (`cli_run.code_digest`); "codes" counts the runs per
digest ("unrecorded" for runs from before it was kept), and the summary says when its runs
measured more than one version. The plot: held-out CE against wall-clock for every run, and
beside it each seed's ratios (whole run; CE at equal steps and at equal time) with their means
and 95% intervals.

The levers (`--levers_out`): every sparse run with its seed's dense run is also merged into a
table of what was tried, one row per lever (`--l1` and `--sparse_flags`), code digest, seed,
arm and steps (its wall-clock and CE over dense's), with each lever's, code's and arm's mean
over its rows: {"device", "steps", "shape", "eval_batches", "rows": [...], "levers": [{"lever",
"code", "arm", "runs", "seeds", "ce_over_dense", "wall_over_dense"}]}.
"""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import sys
import time

from absl import app
from absl import flags

from benchmarks.common import cli_run
from benchmarks import whole_run

ARMS = ("dense", "sparse", "sparse_t")
_KIND = {"dense": "dense_silu", "sparse": "sparse", "sparse_t": "sparse"}


def _define_flags():
  whole_run.define_run_flags(workdir="/tmp/twell_time_to_quality", eval_batches=64,
                             checkpoint_every=0)
  flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4"], "config seeds, one trio of runs each")
  flags.DEFINE_list("arms", list(ARMS), "which runs of each seed")
  flags.DEFINE_float("budget_s", 0.0, "start no run predicted to end past this many seconds "
                     "from the command's start (0: no limit)")
  flags.DEFINE_multi_string("sparse_flags", [], "a train.main flag for the sparse runs only, "
                            "one per --sparse_flags (a lever: "
                            "--sparse_flags=--config.layer_choice.ahead=256,1024:last)")
  flags.DEFINE_integer("equal_time_steps", 0, "sparse_t's steps, instead of reading them off "
                       "the seed's sparse run (0): a lever screened at equal time alone, with "
                       "the step count of an earlier sparse_t")
  flags.DEFINE_string("levers_out", None, "also merge every sparse run, keyed by its lever "
                      "(--l1, --sparse_flags), seed, arm and steps, into this table of levers")
  flags.DEFINE_string("dense_from", None, "take the dense runs of these seeds from this results "
                      "JSON (same device, steps, shape) instead of running them: levers of the "
                      "sparse model against one set of dense runs")
  flags.DEFINE_list("merge", [], "results JSONs (same setting) whose runs to add to --out; "
                    "runs nothing (commands run side by side, on one machine or several)")
  flags.DEFINE_list("gpus", [], "run this many at once, one on each GPU named "
                    "(CUDA_VISIBLE_DEVICES of each run, e.g. 0,1); default: one at a time")
  flags.DEFINE_float("stagger_s", 30.0, "with --gpus, seconds between two runs' starts: a "
                     "run's start (reading the corpus, compiling) is its most host-bound part")


def run_key(run: dict) -> tuple[int, str]:
  return run["seed"], run["arm"]


def eval_seconds(run: dict) -> float:
  """Seconds one held-out evaluation adds to a run: the median over its evaluations of the
  time from the step's logged point to the evaluation's record (0 where none line up)."""
  at = {p["step"]: p["seconds"] for p in run["points"]}
  spans = sorted(e["seconds"] - at[e["step"]] for e in run["evals"] if e["step"] in at)
  return max(0.0, spans[len(spans) // 2]) if spans else 0.0


def equal_time_steps(dense: dict, sparse: dict, steps: int, tokens_per_step: int,
                     eval_every: int) -> int:
  """Steps of sparse_t: the most steps past `steps` that fit in the seconds dense took beyond
  sparse, at sparse's settled speed (the median tokens/s of its last five logged intervals),
  counting the held-out evaluations the extra steps add (one every `eval_every` steps and one
  at the end, each `eval_seconds(sparse)` long)."""
  last = sorted(p["tokens_per_s"] for p in sparse["points"][-5:])
  settled = last[len(last) // 2] / tokens_per_step   # steps per second
  spare, per_eval = dense["wall_s"] - sparse["wall_s"], eval_seconds(sparse)
  n_evals = lambda n: -(-n // eval_every) if eval_every > 0 else 0
  cost = lambda n: (n - steps) / settled + (n_evals(n) - n_evals(steps)) * per_eval
  n = steps + max(0, round(spare * settled))   # an upper bound: evaluations cost >= 0
  while n > steps and cost(n) > spare:
    n -= 1
  return n


def mean_ci(values: list[float]) -> dict:
  """{"mean", "ci95", "n"}: the mean with a Student-t 95% interval (None for one value)."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  n = len(values)
  if not n:
    return {"mean": None, "ci95": None, "n": 0}
  mean = sum(values) / n
  if n == 1:
    return {"mean": mean, "ci95": None, "n": 1}
  sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
  half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
  return {"mean": mean, "ci95": [mean - half, mean + half], "n": n}


def paired_ratio_se(run: dict, base: dict) -> float | None:
  """Standard error of run's final CE over base's from the held-out batches, paired (the
  same batches for both; delta method), or None where either lacks the batches' losses."""
  last = lambda r: (r.get("evals") or [{}])[-1].get("batch_ce")
  x, d = last(run), last(base)
  if not x or not d or len(x) != len(d) or len(x) < 2:
    return None
  n, mean_x, mean_d = len(x), sum(x) / len(x), sum(d) / len(d)
  ratio = mean_x / mean_d
  resid = [xi - ratio * di for xi, di in zip(x, d)]
  mr = sum(resid) / n
  sd = math.sqrt(sum((v - mr) ** 2 for v in resid) / (n - 1))
  return sd / (math.sqrt(n) * mean_d)


def time_to_ce(a: dict, b: dict, target: float, slope: float | None) -> float | None:
  """Seconds a sparse model takes to reach CE `target`, from runs `a` and `b` ({"wall_s",
  "eval_ce"}) on CE(t) = c t^-a (module docstring): interpolated between them where `target`
  lies between their CEs, else extrapolated from the nearer one with the pooled `slope`
  (None where that is needed and `slope` is not positive)."""
  (t1, c1), (t2, c2) = ((r["wall_s"], r["eval_ce"]) for r in (a, b))
  if c1 != c2 and (c1 - target) * (c2 - target) <= 0:
    f = math.log(c1 / target) / math.log(c1 / c2)
    return math.exp(math.log(t1) + f * (math.log(t2) - math.log(t1)))
  if not slope or slope <= 0:
    return None
  t0, c0 = min(((t1, c1), (t2, c2)), key=lambda p: abs(math.log(p[1] / target)))
  return t0 * math.exp(math.log(c0 / target) / slope)


def summarize(results: dict) -> None:
  """Per-seed ratios and their means with intervals (module docstring). A seed's ratio is
  there once the runs it needs are: dense and sparse for the whole run and equal steps, dense
  and sparse_t for equal time, all three for the time to dense CE. The dense runs' own spread
  over seeds (`dense_ce`, `dense_wall_s`) is summarized beside the ratios."""
  by = {run_key(r): r for r in results["runs"]}
  codes = collections.Counter(r.get("code", "unrecorded") for r in results["runs"])
  results["codes"] = dict(sorted(codes.items()))
  seeds = sorted({s for s, _ in by})
  trios = {s: [by.get((s, a)) for a in ARMS] for s in seeds}
  slopes = [(math.log(a["eval_ce"]) - math.log(b["eval_ce"]))
            / (math.log(b["wall_s"]) - math.log(a["wall_s"]))
            for d, a, b in trios.values() if d and a and b and b["wall_s"] > a["wall_s"]]
  slope = sum(slopes) / len(slopes) if slopes else None
  per_seed = []
  for s, (d, a, b) in trios.items():
    if not d or not (a or b):
      continue
    row = {"seed": s, "wall_ratio": None, "ce_ratio_equal_steps": None,
           "ce_ratio_equal_time": None, "time_to_dense_ce_ratio": None}
    if a:
      # Held-out evaluation noise alone (same batches, paired): against the seeds' spread.
      row.update(wall_ratio=d["wall_s"] / a["wall_s"],
                 ce_ratio_equal_steps=a["eval_ce"] / d["eval_ce"],
                 ce_ratio_equal_steps_se=paired_ratio_se(a, d))
    if b:
      row.update(ce_ratio_equal_time=b["eval_ce"] / d["eval_ce"],
                 equal_time_wall_ratio=b["wall_s"] / d["wall_s"],
                 ce_ratio_equal_time_se=paired_ratio_se(b, d), steps_equal_time=b["steps"])
    reached = [r["wall_s"] for r in (a, b) if r and r["eval_ce"] <= d["eval_ce"]]
    if reached:
      # No model: a run that ended at or below dense's CE reached it by its end.
      row["time_to_dense_ce_ratio_at_least"] = d["wall_s"] / min(reached)
    t_star = time_to_ce(a, b, d["eval_ce"], slope) if a and b else None
    if t_star is not None:
      row["time_to_dense_ce_s"] = t_star
      row["time_to_dense_ce_ratio"] = d["wall_s"] / t_star
    per_seed.append(row)
  keys = ("wall_ratio", "ce_ratio_equal_steps", "ce_ratio_equal_time", "time_to_dense_ce_ratio")
  dense = [r for (_, arm), r in sorted(by.items()) if arm == "dense"]
  results["slope"] = slope
  results["per_seed"] = per_seed
  results["summary"] = {k: mean_ci([r[k] for r in per_seed if r[k] is not None]) for k in keys}
  results["summary"]["time_to_dense_ce_ratio_at_least"] = mean_ci(
      [r["time_to_dense_ce_ratio_at_least"] for r in per_seed
       if "time_to_dense_ce_ratio_at_least" in r])
  results["summary"]["dense_ce"] = mean_ci([r["eval_ce"] for r in dense])
  results["summary"]["dense_wall_s"] = mean_ci([r["wall_s"] for r in dense])
  results["phases"] = arm_phases(results["runs"])


def arm_phases(runs: list[dict]) -> dict:
  """{arm: [[label, mean_ci of its seconds]]}: where the wall-clock of dense's and sparse's
  runs at equal steps goes (`whole_run.phases`: start-up to the first step, between
  evaluations, after the last), over the seeds that ran the arm."""
  out = {}
  for arm in ("dense", "sparse"):
    cut = [dict(whole_run.phases(r)) for r in runs
           if r["arm"] == arm and r.get("evals") and "first_step_s" in r]
    labels = list(cut[0]) if cut else []
    out[arm] = [[label, mean_ci([c[label] for c in cut if label in c])] for label in labels]
  return out


def lever_name(l1: float, sparse_flags: list[str]) -> str:
  return " ".join([f"l1={l1:g}", *sparse_flags])


def lever_rows(results: dict) -> list[dict]:
  """One row per sparse run that has its seed's dense run: the lever, the run's steps, wall and
  CE, and both over dense's (with the CE ratio's paired standard error)."""
  by = {run_key(r): r for r in results["runs"]}
  rows = []
  for (seed, arm), run in sorted(by.items()):
    dense = by.get((seed, "dense"))
    if arm == "dense" or not dense:
      continue
    rows.append({"lever": lever_name(results["l1"], results["sparse_flags"]),
                 "code": run.get("code", "unrecorded"),
                 "l1": results["l1"], "sparse_flags": list(results["sparse_flags"]),
                 "seed": seed, "arm": arm, "steps": run["steps"], "wall_s": run["wall_s"],
                 "eval_ce": run["eval_ce"], "dense_wall_s": dense["wall_s"],
                 "dense_ce": dense["eval_ce"], "wall_over_dense": run["wall_s"] / dense["wall_s"],
                 "ce_over_dense": run["eval_ce"] / dense["eval_ce"],
                 "ce_over_dense_se": paired_ratio_se(run, dense)})
  return rows


def merge_levers(table: dict | None, results: dict) -> dict:
  """The table of levers with `results`' rows merged in (a row of the same lever, code, seed,
  arm and steps replaced) and, per lever, code and arm, the mean of each ratio over its rows.
  A lever is its flags over the defaults of the code that ran it: the same flags on another
  version of the code (its digest, "unrecorded" for runs from before it was kept) are another
  lever."""
  setting = {k: results[k] for k in ("device", "steps", "shape", "eval_batches")}
  table = table or {**setting, "rows": []}
  for r in table["rows"]:
    r.setdefault("code", "unrecorded")
  key = lambda r: (r["lever"], r["code"], r["seed"], r["arm"], r["steps"])
  rows = {key(r): r for r in table["rows"]}
  rows.update({key(r): r for r in lever_rows(results)})
  table["rows"] = sorted(rows.values(), key=key)
  groups = {}
  for r in table["rows"]:
    groups.setdefault((r["lever"], r["code"], r["arm"]), []).append(r)
  table["levers"] = [{"lever": lever, "code": code, "arm": arm, "runs": len(rs),
                      "seeds": sorted({r["seed"] for r in rs}),
                      "ce_over_dense": mean_ci([r["ce_over_dense"] for r in rs]),
                      "wall_over_dense": mean_ci([r["wall_over_dense"] for r in rs])}
                     for (lever, code, arm), rs in sorted(groups.items())]
  return table


def corpus_record(dataset: str, tokens_per_step: int, runs: list[dict]) -> dict:
  """The corpus's documents and bytes per split, and its train split's tokens estimated from
  the first dense run (tokens trained on over its passes over the corpus)."""
  from train.corpus import text_corpus  # pylint: disable=import-outside-toplevel
  out = {"name": dataset}
  if dataset in text_corpus.CORPORA:
    for split in text_corpus.SPLITS:
      fp = text_corpus.fingerprint(dataset, split)
      out[split] = {"documents": fp["documents"], "bytes": fp["bytes"]}
  dense = [r for r in runs if r["arm"] == "dense" and r.get("data_passes")]
  if dense:
    out["train_tokens_estimate"] = round(dense[0]["steps"] * tokens_per_step
                                         / dense[0]["data_passes"])
  return out


def plot(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig = plt.figure(figsize=(12, 5))
  grid = fig.add_gridspec(2, 2, width_ratios=(2.2, 1))
  ax = fig.add_subplot(grid[:, 0])
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  styles = {"dense": "-", "sparse": "--", "sparse_t": ":"}
  for r in results["runs"]:
    if not r["evals"]:
      continue
    color = colors[r["seed"] % len(colors)]
    # No error bars: every run is evaluated on the same held-out batches, so the runs'
    # differences are far tighter than one run's spread over batches (per_seed's paired SEs).
    ax.plot([e["seconds"] for e in r["evals"]], [e["ce"] for e in r["evals"]], color=color,
            linestyle=styles[r["arm"]], marker="o", markersize=3,
            label=f"seed {r['seed']} {r['arm']}")
  ax.set_xlabel("wall-clock from the command's start (s)")
  ax.set_ylabel("held-out cross-entropy (the same batches for every run)")
  summary = results.get("summary", {})
  eq = summary.get("ce_ratio_equal_time", {}).get("mean")
  ax.set_title(f"{results['device']}: dense SiLU (solid), sparse at equal steps (dashed), "
               f"at equal time (dotted)" + (f"\nCE at equal time {eq:.3f} of dense, mean over "
                                             f"{summary['ce_ratio_equal_time']['n']} seed(s)"
                                             if eq else ""), fontsize=9)
  ax.legend(fontsize=7, ncol=3)
  top = fig.add_subplot(grid[0, 1])
  _plot_ratios(top, results, ["wall_ratio"], "dense's wall-clock over sparse's", colors)
  top.set_title("dots: seeds; black: mean and 95% interval", fontsize=8)
  _plot_ratios(fig.add_subplot(grid[1, 1]), results,
               ["ce_ratio_equal_steps", "ce_ratio_equal_time"], "sparse's CE over dense's",
               colors)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


_RATIO_LABELS = {"wall_ratio": "whole run", "ce_ratio_equal_steps": "equal steps",
                 "ce_ratio_equal_time": "equal time"}


def _plot_ratios(ax, results: dict, keys: list[str], ylabel: str, colors) -> None:
  """Each seed's ratio (a dot in its seed's colour) and their mean with its 95% interval (a
  black bar), one column per ratio; a line at 1 (parity with dense)."""
  for i, key in enumerate(keys):
    for row in results.get("per_seed", []):
      if row.get(key) is not None:
        ax.plot(i + 0.12 * (row["seed"] % 5 - 2) / 2, row[key], "o", markersize=4,
                color=colors[row["seed"] % len(colors)])
    s = results.get("summary", {}).get(key) or {}
    if s.get("mean") is not None:
      low, high = s["ci95"] or (s["mean"], s["mean"])
      ax.errorbar(i + 0.25, s["mean"], yerr=[[s["mean"] - low], [high - s["mean"]]], fmt="s",
                  color="black", capsize=3, markersize=4)
  ax.axhline(1.0, color="grey", linewidth=0.8)
  ax.set_xticks(range(len(keys)), [_RATIO_LABELS[k] for k in keys], fontsize=8)
  ax.set_xlim(-0.5, len(keys) - 0.5)
  ax.set_ylabel(ylabel, fontsize=8)
  ax.tick_params(labelsize=7)


def predicted_s(runs: list[dict], arm: str, running=()) -> float | None:
  """Seconds the next run of `arm` should take: the last finished one's, else the longest of
  the runs finished and of those of `arm` still `running` (`_start_one`'s), each of these
  extrapolated from its logged steps (its seconds so far over the share of its steps done:
  its start counted in, so on the long side). None with nothing to go by."""
  same = [r["wall_s"] for r in runs if r["arm"] == arm]
  if same:
    return same[-1]
  from train.runtime import metrics  # pylint: disable=import-outside-toplevel
  guesses = [r["wall_s"] for r in runs]
  for r in running:
    logged = [row["step"] for row in metrics.read_jsonl(r["workdir"]) if "tokens_per_s" in row]
    if r["arm"] == arm and logged and logged[-1] > 0:
      guesses.append((time.time() - r["t0"]) * r["steps"] / logged[-1])
  return max(guesses, default=None)


def _start_one(fl, seed: int, arm: str, steps: int, data_flags: list[str],
               gpu: str | None) -> dict:
  """Starts one run's `train.main` (on GPU `gpu` alone where given): what `_finish_one` needs."""
  spec = f"{_KIND[arm]}+seed={seed}" + (f"+num_train_steps={steps}" if steps != fl.steps else "")
  cmd, workdir = whole_run.run_command(fl, spec, seed, data_flags, name=f"{seed}_{arm}")
  if arm != "dense":
    cmd += fl.sparse_flags
  where = "" if gpu is None else f" on GPU {gpu}"
  print(f"  seed {seed} {arm} ({steps} steps){where}: {' '.join(cmd[3:])}", flush=True)
  env = {} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu}
  proc, t0 = cli_run.start(cmd, workdir + ".log", **env)
  return {"proc": proc, "t0": t0, "spec": spec, "workdir": workdir, "seed": seed, "arm": arm,
          "steps": steps, "gpu": gpu}


def _finish_one(fl, started: dict) -> dict:
  """Waits for a `_start_one` run: its record (whole_run's, with seed, arm, steps, gpu)."""
  seed, arm = started["seed"], started["arm"]
  wall = cli_run.finish(started["proc"], started["t0"], fl.timeout, f"seed {seed} {arm}")
  from train.config import workdir as workdir_config  # pylint: disable=import-outside-toplevel
  run = whole_run.read_run(started["spec"], started["workdir"], wall, started["t0"])
  cfg = workdir_config.read_workdir_config(started["workdir"])
  run.update(seed=seed, arm=arm, steps=started["steps"], gpu=started["gpu"],
             host_gpus=len(cli_run.gpu_names()), started_at=started["t0"],
             tokens_per_step=cfg["batch_size"] * cfg["data"]["seq_len"])
  print(f"  seed {seed} {arm}: {wall:.1f} s, held-out CE {run['eval_ce']:.4f}", flush=True)
  return run


def _steps_of(fl, seed: int, arm: str, done: dict) -> int | None:
  """The steps of run (seed, arm); None while sparse_t waits for its seed's dense and sparse."""
  if arm != "sparse_t":
    return fl.steps
  if fl.equal_time_steps:
    return fl.equal_time_steps
  if (seed, "dense") not in done or (seed, "sparse") not in done:
    return None
  sparse = done[(seed, "sparse")]
  return equal_time_steps(done[(seed, "dense")], sparse, fl.steps, sparse["tokens_per_step"],
                          fl.eval_every)


def run_all(fl, results: dict, seeds: list[int], data_flags: list[str], code: str,
            t_start: float) -> None:
  """Runs every (seed, arm) of `seeds` x `--arms` not in `results` yet, in that order, each
  alone on one GPU: with `--gpus` as many at once as GPUs named (each run takes the first free
  GPU and the first waiting run it can start, `--stagger_s` after the last start), else one
  after the other. A run starts only when `--budget_s` leaves it time by the runs already
  timed; sparse_t starts once its seed's dense and sparse are done. `results` is saved after
  every run. However this stops (a failed run, a time limit's SIGTERM), no run is left behind
  on the GPUs."""
  done = {run_key(r): r for r in results["runs"]}
  waiting = [(s, a) for s in seeds for a in ARMS if a in fl.arms and (s, a) not in done]
  free = list(fl.gpus) or [None]
  running: list[dict] = []
  last_start = -math.inf
  staggered = lambda: not running or time.time() - last_start >= fl.stagger_s
  # SIGTERM ends the command, but not while a run starts: its process would be left unknown
  # to the clean-up below; the run recorded first, the command then ends.
  starting = {"now": False, "stopped": False}

  def on_sigterm(*_):
    if starting["now"]:
      starting["stopped"] = True
    else:
      sys.exit(143)

  previous = signal.signal(signal.SIGTERM, on_sigterm)
  try:
    while waiting or running:
      held = False   # a GPU free and a run waiting for the stagger only
      for key in list(waiting):
        if not free:
          break
        if not staggered():
          held = True
          break
        seed, arm = key
        steps = _steps_of(fl, seed, arm, done)
        if steps is None:
          if not any((seed, a) in waiting or (seed, a) in
                     {(r["seed"], r["arm"]) for r in running} for a in ("dense", "sparse")):
            print(f"  seed {seed} sparse_t waits for that seed's dense and sparse runs")
            waiting.remove(key)
          continue
        predicted = predicted_s(results["runs"], arm, running)
        if fl.budget_s and predicted and time.time() - t_start + predicted > fl.budget_s:
          print(f"  seed {seed} {arm} left for the next command: predicted {predicted:.0f} s, "
                f"{fl.budget_s - (time.time() - t_start):.0f} s of the budget left",
                flush=True)
          waiting.remove(key)
          continue
        waiting.remove(key)
        starting["now"] = True
        try:
          running.append(_start_one(fl, seed, arm, steps, data_flags, free.pop(0)))
        finally:
          starting["now"] = False
        if starting["stopped"]:
          sys.exit(143)
        last_start = time.time()
      if not running:   # every run left has started, ended or been left for the next command
        break
      while not any(r["proc"].poll() is not None for r in running):
        if held and staggered():
          break
        time.sleep(0.5)
      ended = next((r for r in running if r["proc"].poll() is not None), None)
      if ended is None:   # the stagger over: start the next run
        continue
      running.remove(ended)
      free.append(ended["gpu"])
      run = _finish_one(fl, ended)
      run["code"] = code
      results["runs"].append(run)
      done[run_key(run)] = run
      _save(fl, results)
  finally:
    for other in running:
      other["proc"].kill()
      other["proc"].wait()
    signal.signal(signal.SIGTERM, previous)


def _load(path: str | None) -> dict | None:
  if path and os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return None


def main(argv):
  del argv
  fl = flags.FLAGS
  if fl.smoke:
    whole_run.set_smoke(fl)
  bad = [a for a in fl.arms if a not in ARMS]
  if bad:
    raise app.UsageError(f"--arms: {bad} not in {ARMS}")
  seeds = [int(s) for s in fl.seeds]
  t_start = time.time()
  merged = [_load(path) for path in fl.merge]
  if None in merged:
    raise app.UsageError(f"--merge: no such file {fl.merge[merged.index(None)]}")
  # Merging runs nothing: the device is the one the merged runs ran on.
  device = merged[0]["device"] if merged else cli_run.device_name()
  code = cli_run.code_digest()
  setting = {"device": device, "steps": fl.steps, "shape": fl.shape, "l1": fl.l1,
             "eval_batches": fl.eval_batches, "sparse_flags": list(fl.sparse_flags)}
  results = _load(fl.out) or {**setting, "runs": []}
  _check_setting(results, setting, fl.out)
  shared = {k: setting[k] for k in ("device", "steps", "shape", "eval_batches")}
  _check_setting(_load(fl.levers_out) or {}, shared, fl.levers_out)
  for path, other in zip(fl.merge, merged):
    _check_setting(other, setting, path)
    have = {run_key(r) for r in results["runs"]}
    twice = [k for k in map(run_key, other["runs"]) if k in have]
    if twice:
      raise app.UsageError(f"--merge: {path} has runs (seed, arm) {twice} already in "
                           f"{fl.out or 'an earlier file'}")
    results["runs"] += other["runs"]
    results.setdefault("corpus", other.get("corpus"))
  if fl.dense_from:
    other = _load(fl.dense_from)
    if other is None:
      raise app.UsageError(f"--dense_from={fl.dense_from}: no such file")
    _check_setting(other, shared, fl.dense_from)
    have = {run_key(r) for r in results["runs"]}
    results["runs"] += [r for r in other["runs"] if r["arm"] == "dense"
                        and r["seed"] in seeds and run_key(r) not in have]
    results["dense_from"] = os.path.basename(fl.dense_from)
  if not merged:
    os.makedirs(fl.workdir, exist_ok=True)
    tokenizer = cli_run.tokenizer_record(fl.tokenizer, fl.dataset)
    data_flags = cli_run.data_flags(fl.dataset, tokenizer)
    print(f"  the corpus read ahead in {whole_run.warm_corpus(fl.dataset):.1f} s", flush=True)
    run_all(fl, results, seeds, data_flags, code, t_start)
  results["seeds"] = sorted({r["seed"] for r in results["runs"]})
  if results["runs"]:
    results["tokens_per_step"] = results["runs"][0]["tokens_per_step"]
    # The corpus as the machine that ran them reads it (merging: as the merged files say).
    corpus = None if merged else corpus_record(fl.dataset, results["tokens_per_step"],
                                               results["runs"])
    results["corpus"] = corpus or results.get("corpus")
  summarize(results)
  _save(fl, results)
  _print(results)
  if fl.levers_out:
    table = merge_levers(_load(fl.levers_out), results)
    os.makedirs(os.path.dirname(os.path.abspath(fl.levers_out)), exist_ok=True)
    with open(fl.levers_out, "w") as f:
      json.dump(table, f, indent=1)
    print_levers(table)


def _check_setting(results: dict, setting: dict, path: str) -> None:
  for key, want in setting.items():
    if results.get(key, want) != want:
      raise app.UsageError(f"{path} holds runs with {key}={results[key]!r}, not {want!r}: "
                           "write to another --out")


def _save(fl, results: dict) -> None:
  if fl.out:
    os.makedirs(os.path.dirname(os.path.abspath(fl.out)), exist_ok=True)
    with open(fl.out, "w") as f:
      json.dump(results, f, indent=1)
  if fl.plot and results["runs"]:
    plot(results, fl.plot)


def _print(results: dict) -> None:
  for r in results["runs"]:
    print(f"  seed {r['seed']} {r['arm']:<8} {r['steps']:5d} steps  wall {r['wall_s']:7.1f} s  "
          f"held-out CE {r['eval_ce']:.4f} +- {r['evals'][-1].get('ce_se') or 0:.4f}  "
          f"passes {r.get('data_passes') or 0:.3f}")
  for row in results["per_seed"]:
    print("  seed {seed}: ".format(**row) + "  ".join(
        f"{k} {v:.3f}" for k, v in row.items() if k != "seed" and isinstance(v, float)))
  if len(results.get("codes", {})) > 1:
    print("  the runs measured more than one version of the code (runs per digest): "
          + ", ".join(f"{c} {n}" for c, n in results["codes"].items()))
  for arm, cut in results.get("phases", {}).items():
    if cut:
      print(f"  {arm} by phase, seconds: " + ", ".join(
          f"{label} {v['mean']:.1f}" for label, v in cut))
  for k, v in results["summary"].items():
    ci = v["ci95"]
    print(f"  {k}: " + ("n/a" if v["mean"] is None else f"{v['mean']:.3f}") +
          (f" (95% interval {ci[0]:.3f} to {ci[1]:.3f}, {v['n']} seeds)" if ci else
           f" ({v['n']} seeds)"))


def print_levers(table: dict) -> None:
  for g in table["levers"]:
    ce, wall = g["ce_over_dense"], g["wall_over_dense"]
    ci = f" ({ce['ci95'][0]:.3f} to {ce['ci95'][1]:.3f})" if ce["ci95"] else ""
    print(f"  {g['lever']:<40} code {g['code']:<12} {g['arm']:<8} {g['runs']} run(s), "
          f"seeds {g['seeds']}: "
          f"CE {ce['mean']:.3f}{ci} and wall-clock {wall['mean']:.3f} of dense's")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
