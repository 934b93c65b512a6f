r"""The user's measure: whole training runs from random initialisation, sparse against dense SiLU.

    python -m benchmarks.whole_run --out=whole_run.json --plot=whole_run.png   # GPU(s)
    python -m benchmarks.whole_run --smoke --out=/tmp/w.json                   # CPU, a minute

Every run is the command a user types (`python -m train.main`, its own workdir and an empty
compilation cache, as a first run on a machine), from the config's seed on the same token
stream: the offline corpus of Python sources with a 32k SentencePiece tokenizer trained on it
offline (`benchmarks.common.cli_run`), the paper 0.5B shape at 8 x 2048 tokens a step
(`benchmarks.common.trained.SHORT_RUN`: learning rate 1e-3, 100 warm-up steps, cosine over the run),
trainer defaults otherwise (held-out evaluations every `--eval_every` steps, checkpoints every
`--checkpoint_every`). Runs (`--runs`):

  dense_silu   the baseline: dense SiLU-gated FFN, no L1 (`configs/paper_0p5b.py:dense`)
  sparse       ReLU + L1 `--l1` with the default FFN choice (each layer's hot features
               per layer, `train.models.layer_choice`); named twice, it runs twice, to show the
               spread
  NAME@DIR     run NAME from the checkout in DIR (another version of the code)
  NAME+KEY=VALUE[+KEY=VALUE...]
               run NAME with config overrides (--config.KEY=VALUE), e.g.
               sparse+layer_choice.landing_steps=200: a variant beside the default runs
Runs of another checkout or with overrides get their own ratios to dense SiLU but stay out of
the summary's (`wall_ratios`, `same_decisions`).

With `--parallel` the runs start together (or `--stagger_s` apart), one GPU each (each process
sees only its GPU; the runs share the host's CPUs, where a choice's build runs, so landings can
wait on them); otherwise one after the other on the first GPU. GPU training is not bitwise reproducible by default, and two runs of one seed can
decide differently near a threshold; `--deterministic` runs every command with XLA's
deterministic GPU ops (the training kernels use no atomics; the model then takes XLA's
attention, `train.models.implementations.attention`). Before the runs the offline
corpus is read once, untimed (`warm_corpus`): every run starts with the same warm file cache
and corpus cache.

A cluster's run (`--processes=N`): each run as N processes of one GPU each, started by
`python -m train.launch` (process 0's log in the run's, every process's in WORKDIR.processes/).
A run longer than one command may take (`--stop_after_s`): stopped with a checkpoint, then
continued by the same command, its wall-clock the sum of its commands' (`benchmarks.common.run_calls`;
"calls_s" lists them). `--dense_flags` go to the dense SiLU runs only (its micro-batch).

Per run: the command's wall-clock (start-up, compiles, evaluations, checkpoints included), the
time to its first step, held-out cross-entropy at every evaluation, and at every logged step
tokens/s, active features per token and rows that left the sparse kernels per layer, the
number of layers gathering features and their hot features; the per-layer decisions and the
steps they land on. JSON (`--out`): {"device", "steps", "tokens_per_step", "gpus_per_run" (1
with `--parallel`, else every GPU of the machine: a data-parallel mesh), "runs": [{"name",
"wall_s", "eval_ce", "evals": [{"step", "seconds", "ce", "ce_se" (its standard error over the
batches), "tokens", "batch_ce" (each held-out batch's)}], "data_passes" (over the corpus),
"points": [{"step", "tokens_per_s", "active_per_token", "overflow_rows", "sparse_layers",
"hot_features"}], "decisions": [[step, choice, landing step]],
"landing_waits_s": [[step, seconds the loop waited for that landing's build]],
"landing_late_steps": [[step, steps after the step its decision named: positive where its build
was not done by then, negative where it was done before]], "build_s": [[step, seconds that landing's build took]], ...,
"phases" ([label, seconds] of the wall-clock cut at the first step and the evaluations,
`phases`), "phase_ratios" (dense SiLU's seconds over the run's, per phase)}], "wall_ratios"
(dense SiLU's wall-clock over each sparse run's), "ce_ratios" and "ce_ratio" (the largest),
"same_decisions"}. The plot: each sparse run's speed over dense SiLU's between logged steps
(wall-clock, evaluations included),
and the first sparse run's activity per layer, against steps.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags

from benchmarks.common import cli_run
from benchmarks.common import run_calls


def define_run_flags(**defaults) -> None:
  """The flags that set up every run (shape, steps, schedule, evaluation, data), shared with
  `benchmarks.time_to_quality`; `defaults` overrides some defaults."""
  d = {"workdir": "/tmp/twell_whole_run", "steps": 2500, "eval_every": 500, "eval_batches": 16,
       "checkpoint_every": 1000, "timeout": 3000, **defaults}
  flags.DEFINE_string("out", None, "results JSON")
  flags.DEFINE_string("plot", None, "PNG of the results")
  flags.DEFINE_string("workdir", d["workdir"], "where the runs' workdirs go")
  flags.DEFINE_bool("smoke", False, "CPU smoke mode: tiny shape, byte tokenizer, a few steps")
  flags.DEFINE_string("shape", "paper_0p5b", "config (configs/<shape>.py)")
  flags.DEFINE_integer("steps", d["steps"], "training steps of every run")
  flags.DEFINE_float("l1", 2e-5, "L1 coefficient of the sparse runs")
  flags.DEFINE_integer("warmup_steps", 100, "learning-rate warm-up")
  flags.DEFINE_integer("log_every", 50, "logging interval (each point of the curves)")
  flags.DEFINE_integer("eval_every", d["eval_every"], "held-out evaluation interval")
  flags.DEFINE_integer("eval_batches", d["eval_batches"], "batches per held-out evaluation")
  flags.DEFINE_integer("checkpoint_every", d["checkpoint_every"], "checkpoint interval (0: none)")
  flags.DEFINE_string("dataset", cli_run.DEFAULT_DATASET, "offline corpus")
  flags.DEFINE_string("tokenizer", cli_run.DEFAULT_TOKENIZER, "SentencePiece model path "
                      "without .model (trained offline if missing), or 'byte'")
  flags.DEFINE_list("extra_flags", [], "more train.main flags for every run")
  flags.DEFINE_integer("timeout", d["timeout"], "seconds per run")


def set_smoke(fl) -> None:
  """`--smoke`: the tiny shape on the docstring corpus with bytes, a few steps, on the CPU."""
  fl.shape, fl.dataset, fl.tokenizer = "tiny", "twell_stdlib_text", "byte"
  fl.steps, fl.log_every, fl.eval_every, fl.eval_batches = 6, 2, 6, 2
  fl.checkpoint_every, fl.warmup_steps = 3, 2
  # On the CPU the default FFN is dense; the portable sparse one makes the decisions.
  fl.extra_flags = [*fl.extra_flags, "--config.layer_choice.sparse=xla",
                    "--config.layer_choice.every=2"]


def _define_flags():
  define_run_flags()
  flags.DEFINE_list("runs", ["dense_silu", "sparse", "sparse"], "runs, in order: dense_silu or "
                    "sparse; NAME@DIR runs NAME from the checkout in DIR (another version of "
                    "the code); NAME+KEY=VALUE+... with config overrides")
  flags.DEFINE_bool("parallel", False, "start the runs together, one GPU each")
  flags.DEFINE_bool("deterministic", False, "every run with XLA's deterministic GPU ops "
                    "(--xla_gpu_deterministic_ops): bitwise-reproducible training, so runs of "
                    "one seed can be compared decision for decision")
  flags.DEFINE_list("gpus", [], "with --parallel, the GPUs to use (default: all)")
  flags.DEFINE_float("stagger_s", 0.0, "with --parallel, seconds between the runs' starts: "
                     "runs that start together also write their checkpoints together")
  flags.DEFINE_list("merge", [], "results JSONs of earlier invocations on the same kind of "
                    "device whose runs come first (one GPU and a time limit per command: one "
                    "run per invocation, then --runs= --merge=a.json,b.json,c.json)")
  flags.DEFINE_integer("processes", 1, "each run as this many processes, one GPU each "
                       "(python -m train.launch, as a cluster starts them), on that many GPUs")
  flags.DEFINE_float("stop_after_s", None, "stop a run still training after this many seconds "
                     "of this command (SIGTERM through train.launch: it writes a checkpoint); "
                     "the same command again continues it, its wall-clock the sum of its "
                     "commands' (benchmarks.common.run_calls)")
  flags.DEFINE_list("dense_flags", [], "more train.main flags for the dense SiLU runs only "
                    "(its micro-batch: --config.grad_accum_steps=1)")


RUN_KINDS = ("dense_silu", "sparse")


def parse_run(spec: str) -> tuple[str, list[str], str]:
  """A `--runs` entry as (kind, config override flags, checkout dir or "")."""
  name, _, root = spec.partition("@")
  kind, *overrides = name.split("+")
  if kind not in RUN_KINDS:
    raise app.UsageError(f"run {spec!r}: {kind!r} is not one of {', '.join(RUN_KINDS)}")
  for o in overrides:
    if "=" not in o or o.startswith("="):
      raise app.UsageError(f"run {spec!r}: override {o!r} is not KEY=VALUE")
  return kind, [f"--config.{o}" for o in overrides], root


def _in_summary(run: dict) -> bool:
  """Runs of this checkout with the defaults (not NAME@DIR, not NAME+KEY=VALUE)."""
  return "@" not in run["name"] and "+" not in run["name"]


def run_command(fl, spec: str, index: int, data_flags: list[str],
                name: str | None = None) -> tuple[list[str], str]:
  """(the `train.main` command of run `spec` (the `index`-th), its workdir: `name` under
  `--workdir`, by default "INDEX_KIND")."""
  from benchmarks.common import trained  # pylint: disable=import-outside-toplevel
  kind, overrides, _ = parse_run(spec)
  workdir = os.path.join(fl.workdir, name or f"{index}_{kind}")
  dense = kind == "dense_silu"
  config = f"configs/{fl.shape}.py" + (":dense" if dense else "")
  schedule = (trained.short_run_flags(fl.warmup_steps) if fl.shape.startswith("paper_")
              else [f"--config.warmup_steps={fl.warmup_steps}"])
  model = [] if dense else ["--config.model.ffn_activation=relu", f"--config.l1_coeff={fl.l1}"]
  cmd = cli_run.command(workdir, config, fresh=not run_calls.continues(workdir), flags=[
      f"--config.num_train_steps={fl.steps}", f"--config.log_every={fl.log_every}",
      f"--config.eval_every={fl.eval_every}", f"--config.eval_batches={fl.eval_batches}",
      f"--config.checkpoint_every={fl.checkpoint_every}", "--config.keep_checkpoints=1",
      *schedule, *data_flags, *model, *fl.extra_flags, *overrides])
  return cmd, workdir


def read_run(name: str, workdir: str, wall_s: float, t0) -> dict:
  """A finished run's measurements (module docstring) from its metrics.jsonl. `t0`: its start
  (time.time()), or for a run over several commands a function from a moment to the run's
  seconds (`benchmarks.common.run_calls.clock`)."""
  from train.runtime import metrics  # pylint: disable=import-outside-toplevel
  seconds = t0 if callable(t0) else (lambda moment: moment - t0)
  rows = metrics.read_jsonl(workdir)
  train_rows = [r for r in rows if "tokens_per_s" in r]
  layers = sorted(int(k.rsplit("_", 1)[1]) for k in train_rows[-1]
                  if k.startswith("active_per_token/"))
  per_layer = lambda r, key: [r.get(f"{key}/layer_{l}") for l in layers]
  points = [{"step": r["step"], "seconds": seconds(r["wall_time"]),
             "tokens_per_s": r["tokens_per_s"],
             "active_per_token": per_layer(r, "active_per_token"),
             "overflow_rows": [int(v) for v in per_layer(r, "overflow_rows")],
             "sparse_layers": int(r.get("sparse_layers", 0)),
             "hot_features": [int(v) for v in per_layer(r, "hot_features")]
                             if "hot_features/layer_0" in r else None}
            for r in train_rows]
  decisions = [[e["step"], e["choice"], e["runs_from"]]
                for e in metrics.events(rows, "ffn_decision")]
  # [step, seconds] of each landing: how long the loop waited for the choice's build.
  landings = metrics.events(rows, "ffn_landing")
  waits = [[e["step"], e["waited_s"]] for e in landings]
  late = [[e["step"], e.get("late_steps", 0)] for e in landings]
  builds = [[e["step"], e["build_s"]] for e in landings]
  batch_losses = {e["step"]: e["losses"] for e in metrics.events(rows, "eval_batch_losses")}
  evals = [{"step": r["step"], "seconds": seconds(r["wall_time"]), "ce": r["eval/loss"],
            "ce_se": r.get("eval/loss_se"), "tokens": r.get("eval/tokens"),
            "batch_ce": batch_losses.get(r["step"])}
           for r in rows if "eval/loss" in r]
  return {"name": name, "wall_s": wall_s,
          "first_step_s": seconds(train_rows[0]["wall_time"]),
          "eval_ce": evals[-1]["ce"] if evals else None, "evals": evals, "points": points,
          "data_passes": train_rows[-1].get("data_passes"),
          "decisions": decisions, "landing_waits_s": waits, "landing_late_steps": late,
          "build_s": builds,
          "peak_memory_gib": max((r["peak_memory_gib"] for r in rows if "peak_memory_gib" in r),
                                 default=None)}


def _intervals(points) -> dict:
  """{step: seconds since the previous logged step} of a run's points (the first left out)."""
  return {b["step"]: b["seconds"] - a["seconds"] for a, b in zip(points, points[1:])
          if b["seconds"] > a["seconds"]}


def phases(run: dict) -> list[list]:
  """[label, seconds] of a run's wall-clock cut at its first step and its evaluations: "start"
  (start-up and the first step's compile), "1-500", "500-1000", ... (each ending with that
  step's evaluation; a checkpoint on that step falls in the next one), "end" (after the last
  evaluation: the final checkpoint's write and the process's exit). They sum to `wall_s`."""
  out, last, since = [["start", run["first_step_s"]]], run["first_step_s"], 1
  for e in run["evals"]:
    out.append([f"{since}-{e['step']}", e["seconds"] - last])
    last, since = e["seconds"], e["step"]
  out.append(["end", run["wall_s"] - last])
  return out


def warm_corpus(dataset: str) -> float:
  """Reads every document of an offline corpus once, untimed, so that every run starts as a
  user's second run on the machine does: the splits' keys in the corpus cache
  (`text_corpus.split_keys`, which reads and hashes the whole corpus where they are not) and
  the files in the OS's file cache. On a fresh machine the first run otherwise pays the cold
  reads, whichever run goes first. Returns the seconds it took (0 for a corpus of the user's
  files)."""
  from train.corpus import text_corpus  # pylint: disable=import-outside-toplevel
  if dataset not in text_corpus.CORPORA:
    return 0.0
  t0 = time.perf_counter()
  if dataset == text_corpus.NAME:
    text_corpus.documents("validation", dataset)
  else:
    for split in text_corpus.SPLITS:
      files = text_corpus.document_files(split, dataset)
      files.get_many(range(len(files)))
  return time.perf_counter() - t0


def summarize(results: dict) -> None:
  """The ratios to dense SiLU (module docstring); runs of another checkout or with overrides
  get theirs but stay out of the summary."""
  runs = results["runs"]
  base = next((r for r in runs if r["name"] == "dense_silu"), None)
  sparse = [r for r in runs if r is not base and _in_summary(r)]
  results["same_decisions"] = (all(r["decisions"] == sparse[0]["decisions"] for r in sparse)
                               if len(sparse) > 1 else None)
  for r in runs:
    r["phases"] = phases(r)
  if base is None:
    return
  for r in runs:
    if r is base:
      continue
    r["wall_ratio"] = base["wall_s"] / r["wall_s"]
    # Where the whole-run ratio comes from: dense SiLU's seconds over this run's, per phase.
    dense_phases = dict(base["phases"])
    r["phase_ratios"] = [[label, dense_phases[label] / sec] for label, sec in r["phases"]
                         if label in dense_phases and sec > 0]
    if r["eval_ce"] is not None and base["eval_ce"]:
      r["ce_ratio"] = r["eval_ce"] / base["eval_ce"]
    # Dense SiLU's wall-clock over this run's between consecutive logged steps (evaluations,
    # checkpoints and waits included: the user's measure, step by step). The first logged
    # step holds each command's start-up and compiles: left out.
    dense_dt = _intervals(base["points"])
    r["step_ratios"] = [[step, dense_dt[step] / dt]
                        for step, dt in _intervals(r["points"]).items() if step in dense_dt]
  if not sparse:
    return
  results["wall_ratios"] = [r["wall_ratio"] for r in sparse]
  results["ce_ratios"] = [r.get("ce_ratio") for r in sparse]
  results["ce_ratio"] = max((c for c in results["ce_ratios"] if c is not None), default=None)


def plot(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  sparse = [r for r in results["runs"] if r["name"] != "dense_silu"]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
  for i, r in enumerate(sparse):
    if r.get("step_ratios"):
      steps, ratios = zip(*r["step_ratios"])
      top.plot(steps, ratios, marker="o", markersize=2,
               label=f"{r['name']} {i + 1}: whole run {r.get('wall_ratio', 0):.3f}x")
  top.axhline(1.0, color="gray", linewidth=0.8)
  top.set_ylabel("dense SiLU's seconds over sparse's\nbetween logged steps")
  top.set_title(f"{results.get('device', '')}: per step, from random initialisation")
  top.legend(fontsize=8)
  if sparse:
    pts = sparse[0]["points"]
    for l in range(len(pts[-1]["active_per_token"])):
      bottom.plot([p["step"] for p in pts], [p["active_per_token"][l] for p in pts],
                  label=f"layer {l}")
  bottom.set_yscale("log")
  bottom.set_xlabel("step")
  bottom.set_ylabel("active features per token")
  bottom.legend(fontsize=7, ncol=4)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  fl = flags.FLAGS
  if fl.smoke:
    set_smoke(fl)
  parsed = [parse_run(spec) for spec in fl.runs]   # every entry checked before anything runs
  if fl.processes > 1 and fl.parallel:
    raise app.UsageError("--processes: each run takes that many GPUs; not with --parallel")
  os.makedirs(fl.workdir, exist_ok=True)
  tokenizer = cli_run.tokenizer_record(fl.tokenizer, fl.dataset)
  data_flags = cli_run.data_flags(fl.dataset, tokenizer)
  if fl.runs:
    print(f"  the corpus read ahead in {warm_corpus(fl.dataset):.1f} s",
          flush=True)
  gpus = cli_run.gpu_names()
  results = {"device": gpus[0] if gpus else "cpu", "steps": fl.steps, "shape": fl.shape,
             "l1": fl.l1, "parallel": fl.parallel, "deterministic": fl.deterministic,
             "gpus_per_run": (1 if fl.parallel or not gpus else
                              fl.processes if fl.processes > 1 else len(gpus)),
             "processes_per_run": fl.processes,
             "tokenizer": (tokenizer or {}).get("model"), "runs": []}
  for path in fl.merge:
    with open(path) as f:
      earlier = json.load(f)
    if earlier["device"] != results["device"] and gpus:
      raise app.UsageError(f"{path} ran on {earlier['device']}, not {results['device']}")
    results["device"] = earlier["device"]
    results["runs"] += earlier["runs"]
    if not fl.runs:   # only merging: the setting is the earlier runs'
      for key in ("steps", "shape", "l1", "parallel", "deterministic", "tokenizer",
                  "gpus_per_run"):
        results[key] = earlier.get(key, results[key])
    results.setdefault("tokens_per_step", earlier.get("tokens_per_step"))
  started = []
  for i, spec in enumerate(fl.runs):
    root = parsed[i][2]
    cmd, workdir = run_command(fl, spec, i, data_flags)
    ids = fl.gpus or [str(g) for g in range(len(gpus))]
    env = {"CUDA_VISIBLE_DEVICES": ids[i % len(ids)]} if fl.parallel and gpus else {}
    if fl.deterministic:
      env["XLA_FLAGS"] = " ".join(
          [os.environ.get("XLA_FLAGS", ""), "--xla_gpu_deterministic_ops=true"]).strip()
    if fl.parallel and started and fl.stagger_s > 0:
      time.sleep(fl.stagger_s)
    cmd = launched(fl, cmd, parsed[i][0], workdir)
    print(f"  {spec} ({i}): {' '.join(cmd[3:])}", flush=True)
    proc = cli_run.start(cmd, workdir + ".log", os.path.abspath(root or cli_run.ROOT), **env)
    started.append((spec, workdir, env, *proc))
    if not fl.parallel:
      _finish(fl, results, *started.pop())
  walls = cli_run.wait_all([item[3:] for item in started], fl.timeout)
  for item, wall in zip(started, walls):
    _finish(fl, results, *item, wall=wall)
  if fl.runs:
    from train.config import workdir as workdir_config  # pylint: disable=import-outside-toplevel
    cfg = workdir_config.read_workdir_config(
        os.path.join(fl.workdir, f"0_{parsed[0][0]}"))
    results["tokens_per_step"] = cfg["batch_size"] * cfg["data"]["seq_len"]
  summarize(results)
  if fl.out:
    with open(fl.out, "w") as f:
      json.dump(results, f, indent=1)
  if fl.plot:
    plot(results, fl.plot)
  for r in results["runs"]:
    print(f"  {r['name']:<12} wall {r['wall_s']:7.1f} s (first step {r['first_step_s']:.1f} s)"
          f"  held-out CE {r['eval_ce']}  whole-run ratio {r.get('wall_ratio', 1.0):.3f}"
          f"  {len(r['decisions'])} decisions, waited "
          f"{sum(w for _, w in r.get('landing_waits_s', [])):.1f} s for builds (longest "
          f"{max((b for _, b in r.get('build_s', [])), default=0.0):.1f} s), landed "
          f"{sum(max(n, 0) for _, n in r.get('landing_late_steps', [])):d} steps late and "
          f"{sum(max(-n, 0) for _, n in r.get('landing_late_steps', [])):d} early", flush=True)
  for r in results["runs"]:
    ratios = dict(r.get("phase_ratios", []))
    print(f"  {r['name']:<12} " + " | ".join(
        f"{label} {sec:.1f} s" + (f" ({ratios[label]:.2f}x)" if label in ratios else "")
        for label, sec in r["phases"]), flush=True)
  print(f"wall ratios {results.get('wall_ratios')}  CE ratio {results.get('ce_ratio')}  "
        f"same decisions {results.get('same_decisions')}")


def launched(fl, cmd: list[str], kind: str, workdir: str) -> list[str]:
  """A run's `train.main` command with the dense SiLU runs' own flags, through `train.launch`
  for several processes (each one's log in WORKDIR.processes/, process 0's in the run's) or a
  time limit."""
  cmd = cmd + (fl.dense_flags if kind == "dense_silu" else [])
  if fl.processes == 1 and fl.stop_after_s is None:
    return cmd
  limit = [] if fl.stop_after_s is None else [f"--stop_after_s={fl.stop_after_s}"]
  return [*cmd[:2], "train.launch", f"--num_processes={fl.processes}",
          f"--process_logs={workdir}.processes", *limit, "--", *cmd[3:]]


def _finish(fl, results: dict, name: str, workdir: str, env: dict, proc, t0: float,
            wall: float | None = None) -> None:
  try:
    wall = cli_run.finish(proc, t0, fl.timeout, name, wall)
  except RuntimeError:
    if fl.stop_after_s is None or proc.returncode != 143:   # 143: stopped with a checkpoint
      raise
    from train.state import checkpointing  # pylint: disable=import-outside-toplevel
    calls = run_calls.record(workdir, t0, time.time() - t0 if wall is None else wall)
    print(f"  {name}: stopped after {calls[-1]['wall_s']:.1f} s at step "
          f"{max(checkpointing.steps_on_disk(workdir), default=0)} "
          f"({run_calls.total(calls, 0):.1f} s so far); the same command continues it",
          flush=True)
    return
  calls = run_calls.finish(workdir)
  run = read_run(name, workdir, run_calls.total(calls, wall), run_calls.clock(calls, t0))
  run["calls_s"] = [c["wall_s"] for c in calls] + [wall]
  run["gpu"] = env.get("CUDA_VISIBLE_DEVICES")
  run["started_at"] = t0   # time.time() of its start (runs side by side: their offsets)
  run["xla_flags"] = env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  results["runs"].append(run)
  print(f"  {name}: {wall:.1f} s", flush=True)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
