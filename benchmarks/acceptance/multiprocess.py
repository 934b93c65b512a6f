r"""One process per GPU, as a cluster runs it: train, lose a process, kill, resume; and the speed.

    python -m benchmarks.acceptance.multiprocess --processes=2 --out=mp2.json   # GPUs 0-1
    python -m benchmarks.acceptance.multiprocess --processes=4 --merge=mp2.json \
        --out=multiprocess.json
    python -m benchmarks.acceptance.multiprocess --smoke --out=/tmp/mp.json     # CPU: 2 x 2

A cell is N processes of `python -m train.main`, one GPU each (`train.runtime.launcher`, as
`python -m train.launch` starts them), on a mesh over their N GPUs (`--mesh`; on the CPU, N
processes of `--host_devices` host devices). Its checks (`--parts=checks`):

  1. at once, the same short run four times: uninterrupted (WD/ref); losing its last process,
     SIGKILLed once the first checkpoint is committed (WD/lost); losing process 0, the
     coordinator, there (WD/coordinator); with every process SIGKILLed there (WD/killed). The
     survivors of a lost process must end by themselves within `LOST_LIMIT_S`; those of
     WD/lost with exit status 75 and the line naming the lost process
     (`train.runtime.peer_watch`); those of WD/coordinator name it through the watch or JAX's
     runtime, which aborts them when the coordination service goes ("leader task");
  2. WD/lost and WD/killed rerun with the same command: each must resume from its last committed
     checkpoint and end with the uninterrupted run's train state, every array bit for bit
     (XLA's deterministic GPU reductions on);
  3. `train.evaluate`, `train.generate` and `train.export_hf` on WD/lost, one process each.

Its throughput (`--parts=throughput`): the dense SiLU model at the paper 0.5B shape, 8 rows of
2048 tokens a GPU (a cost that does not depend on the data, which the processes split
differently from one process), trained by one process driving the N GPUs and by N processes,
on the same mesh; tokens/s: the median of the logged windows after the first `WARM_WINDOWS`.

JSON (`--out`): {"device", "cells": [{"processes", "gpus", "devices", "mesh", "steps",
"passed", "checks": {name: bool}, "lost_process_exit_s", "lost_coordinator_exit_s",
"coordinator_named_by", "throughput": {"one_process_tokens_per_s", "processes_tokens_per_s",
"ratio"}, "errors"}], "throughput_ratio" (the lowest cell's)}. A cell passes when every check
holds and, measured on GPUs, the ratio is at least `MIN_RATIO`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

from absl import app
from absl import flags

from benchmarks.acceptance import kill_resume
from benchmarks.acceptance import matrix
from benchmarks.common import cli_run
from train.runtime import launcher
from train.state import checkpointing

LOST_LIMIT_S = 60.0     # how long the survivors of a lost process may take to stop (goal: 30)
MIN_RATIO = 0.98        # N processes' tokens/s over one process's, same mesh
WARM_WINDOWS = 2        # logged windows left out of the throughput (compiles, warm-up)
LOSSES = ("lost", "coordinator", "killed")
# The micro model of the CPU smoke (the tests' `train_test_util.micro_config`).
MICRO = ["--config.model.d_model=32", "--config.model.n_heads=2", "--config.model.n_kv_heads=1",
         "--config.data.seq_len=32", "--config.batch_size=8", "--jax_disable_most_optimizations"]


def _define_flags():
  flags.DEFINE_integer("processes", None, "processes of the cell (default: every GPU; 2 with "
                       "--smoke)")
  flags.DEFINE_string("mesh", "fsdp", "the cell's mesh: data, fsdp (over every device) or "
                      "data=A,fsdp=B")
  flags.DEFINE_list("parts", ["checks", "throughput"], "checks, throughput")
  flags.DEFINE_bool("smoke", False, "CPU: tiny model, 2 processes x 2 host devices")
  flags.DEFINE_integer("host_devices", 2, "without GPUs: host devices per process")
  flags.DEFINE_string("config", "configs/small.py", "the checks' training config")
  flags.DEFINE_integer("steps", 40, "steps of the checks' runs")
  flags.DEFINE_integer("every", 10, "their checkpoint interval")
  flags.DEFINE_integer("throughput_steps", 120, "steps of each throughput run")
  flags.DEFINE_integer("log_every", 20, "the throughput runs' logging interval (a window)")
  flags.DEFINE_float("peer_timeout_s", None, "train.main's --peer_timeout_s (default: its own)")
  flags.DEFINE_enum("isolate", "local_device_ids", list(launcher.ISOLATIONS),
                    "how each process gets its GPU (train.launch --isolate)")
  flags.DEFINE_string("workdir", None, "where the runs go (default: a temporary dir)")
  flags.DEFINE_integer("timeout", 900, "seconds per run")
  flags.DEFINE_list("merge", [], "results JSONs of earlier calls whose cells come first (a "
                    "cell's other part, from another call, joins it)")
  flags.DEFINE_string("out", None, "results JSON")


def settings(fl, gpus: list[str]) -> dict:
  """The cell's settings from the flags and this host's GPUs."""
  n = fl.processes or (2 if fl.smoke or not gpus else len(gpus))
  if gpus and n > len(gpus):
    raise app.UsageError(f"--processes={n}: this host has {len(gpus)} GPUs")
  gpus = gpus[:n]
  devices = n if gpus else n * fl.host_devices
  mesh = fl.mesh if "=" in fl.mesh else f"{fl.mesh}={devices}"
  s = {"processes": n, "gpus": gpus, "devices": devices, "mesh": mesh,
       "host_devices": fl.host_devices, "isolate": fl.isolate, "timeout": fl.timeout,
       "config": fl.config, "steps": fl.steps, "every": fl.every,
       "throughput_steps": fl.throughput_steps, "log_every": fl.log_every,
       "flags": ["--config.batch_size=16", "--config.data.seq_len=512"],
       "throughput_config": "configs/paper_0p5b.py:dense",
       "throughput_flags": [f"--config.batch_size={8 * devices}", "--config.grad_accum_steps=1",
                            "--config.data.dataset=twell_stdlib_text",
                            "--config.data.tokenizer=byte"],
       "peer_timeout_s": fl.peer_timeout_s}
  if fl.smoke:
    # The portable sparse FFN makes the per-layer choice's decisions on the CPU.
    s.update(config="configs/tiny.py", flags=[*MICRO, "--config.layer_choice.sparse=xla"],
             steps=16, every=4, throughput_steps=8,
             log_every=2, throughput_config="configs/tiny.py:dense", throughput_flags=MICRO,
             peer_timeout_s=fl.peer_timeout_s or 10.0)
  return s


def train_flags(s: dict, workdir: str, *, throughput: bool = False) -> list[str]:
  """`train.main`'s flags for a run of cell `s` in `workdir`."""
  if throughput:
    out = [f"--config={s['throughput_config']}", *s["throughput_flags"],
           f"--config.num_train_steps={s['throughput_steps']}",
           f"--config.log_every={s['log_every']}", "--config.checkpoint_every=0"]
  else:
    out = [f"--config={s['config']}", *s["flags"], f"--config.num_train_steps={s['steps']}",
           f"--config.checkpoint_every={s['every']}", f"--config.log_every={s['every']}",
           f"--config.keep_checkpoints={s['steps'] // s['every'] + 1}",
           f"--config.layer_choice.every={s['every']}", "--config.layer_choice.background=False"]
  out += [f"--workdir={workdir}", "--config.eval_every=0", "--config.data.use_tfds=False",
          *matrix.mesh_flags(s["mesh"])]
  if s["peer_timeout_s"] is not None:
    out.append(f"--peer_timeout_s={s['peer_timeout_s']}")
  return out


def environment(s: dict, *, deterministic: bool) -> dict:
  """The runs' environment: the host's GPUs (each process of a job takes its own; without
  GPUs the CPU), the repository on the path; for the checks XLA's deterministic reductions,
  and GPU memory taken as needed (their runs share the GPUs)."""
  env = kill_resume.deterministic_env() if deterministic else cli_run.environment()
  if s["gpus"]:
    if deterministic:
      env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.pop("JAX_PLATFORMS", None)
  else:
    env["JAX_PLATFORMS"] = "cpu"
  return env


def start(s: dict, flags_: list[str], env: dict, log_dir: str) -> launcher.LocalJob:
  """N processes of `train.main` with `flags_`, one GPU each (on the CPU: host devices)."""
  return launcher.LocalJob([sys.executable, "-m", "train.main", *flags_], s["processes"],
                           gpus=s["gpus"], host_devices=s["host_devices"],
                           isolate=s["isolate"], env=env, out=None, log_dir=log_dir,
                           cwd=cli_run.ROOT).start()


def kill_at_first_commit(jobs: dict, workdirs: dict, victims: dict, deadline: float) -> dict:
  """SIGKILLs each job's `victims` processes as soon as its workdir holds a committed
  checkpoint: {name: (the step then committed, the job's seconds at the kill)}; a job that
  ends first, or reaches `deadline`, gets (None, None)."""
  killed, pending = {}, set(jobs)
  while pending and time.monotonic() < deadline:
    for name in sorted(pending):
      job, steps = jobs[name], checkpointing.steps_on_disk(workdirs[name])
      if steps:
        job.signal(signal.SIGKILL, victims[name])
        killed[name] = (steps[-1], job.seconds())
        pending.discard(name)
      elif any(p.poll() is not None for p in job.processes):
        killed[name] = (None, None)
        pending.discard(name)
    time.sleep(0.05)
  return {**{name: (None, None) for name in pending}, **killed}


def _survivors(job: launcher.LocalJob, lost: list[int], kill_s: float) -> list[dict]:
  """How each process not SIGKILLed ended: exit status, seconds after the kill, output."""
  return [{"process": e.process, "returncode": e.returncode, "after_s": e.seconds - kill_s,
           "output": job.output(e.process)}
          for e in job.wait(grace_s=0) if e.process not in lost]


def lose_processes(s: dict, wd: str, env: dict) -> dict:
  """Step 1 (module docstring): the four runs at once. {"checks", the exit times, "killed_at"
  (each loss's committed step at the kill), "errors"}."""
  n, names = s["processes"], ("ref", *LOSSES)
  dirs = {k: os.path.join(wd, k) for k in names}
  jobs = {k: start(s, train_flags(s, dirs[k]), env, os.path.join(wd, "logs", k)) for k in names}
  victims = {"lost": [n - 1], "coordinator": [0], "killed": list(range(n))}
  kills = kill_at_first_commit({k: jobs[k] for k in LOSSES}, dirs, victims,
                               time.monotonic() + s["timeout"])
  for job in jobs.values():   # the survivors get longer than the limit, to be measured
    job.wait(timeout_s=s["timeout"] + LOST_LIMIT_S, grace_s=2 * LOST_LIMIT_S)
  out = {"checks": {}, "errors": [], "killed_at": {k: kills[k][0] for k in LOSSES}}
  ref_ok = all(e.returncode == 0 for e in jobs["ref"].wait())
  out["checks"]["trained"] = ref_ok
  if not ref_ok:
    out["errors"].append("the uninterrupted run failed:\n" + jobs["ref"].output(0)[-1500:])
  for name in LOSSES:
    step, _ = kills[name]
    ok = step is not None and step < s["steps"]
    out["checks"][f"{name}_mid_run"] = ok
    if not ok:
      out["errors"].append(f"{name}: not killed between checkpoints (committed {step}); "
                           "use more --steps")
  if kills["lost"][0] is not None:
    rest = _survivors(jobs["lost"], victims["lost"], kills["lost"][1])
    line = f"error: lost process {n - 1} of {n}"
    out["lost_process_exit_s"] = max(r["after_s"] for r in rest)
    out["checks"]["lost_process_named"] = all(
        r["returncode"] == 75 and line in r["output"] and "Traceback" not in r["output"]
        for r in rest)
    out["checks"]["lost_process_ends_the_others"] = out["lost_process_exit_s"] <= LOST_LIMIT_S
  if kills["coordinator"][0] is not None:
    rest = _survivors(jobs["coordinator"], victims["coordinator"], kills["coordinator"][1])
    out["lost_coordinator_exit_s"] = max(r["after_s"] for r in rest)
    named = [("watch" if f"lost process 0 of {n}" in r["output"] else
              "runtime" if "leader task" in r["output"] else None) for r in rest]
    out["coordinator_named_by"] = sorted(set(map(str, named)))
    out["checks"]["lost_coordinator_ends_the_others"] = (
        None not in named and all(r["returncode"] != 0 for r in rest)
        and out["lost_coordinator_exit_s"] <= LOST_LIMIT_S)
  return out


def resume_and_compare(s: dict, wd: str, env: dict) -> dict:
  """Steps 2 and 3 (module docstring): {"checks", "resumed_from", "errors"}."""
  n, names = s["processes"], ("lost", "killed")
  ref, dirs = os.path.join(wd, "ref"), {k: os.path.join(wd, k) for k in names}
  last = {k: max(checkpointing.steps_on_disk(dirs[k]), default=None) for k in names}
  jobs = {k: start(s, train_flags(s, dirs[k]), env, os.path.join(wd, "logs", f"{k}_rerun"))
          for k in names}
  out = {"checks": {}, "errors": [], "resumed_from": last}
  for k, job in jobs.items():
    ended = job.wait(timeout_s=s["timeout"])
    ok = all(e.returncode == 0 for e in ended) and all(
        f"Resumed from checkpoint step {last[k]}" in job.output(i) for i in range(n))
    out["checks"][f"{k}_resumed"] = ok
    if not ok:
      out["errors"].append(f"the rerun of {k} did not resume from step {last[k]} and finish:\n"
                           + job.output(0)[-1500:])
  with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
    same = {k: pool.submit(matrix.compare_states, ref, dirs[k]) for k in names}
    done, errors = matrix.run_tools(dirs["lost"], wd, env, s["timeout"])
    for k, fut in same.items():
      try:
        result = fut.result()
        out["checks"][f"{k}_same_state"] = bool(result["equal"])
        if not result["equal"]:
          out["errors"].append(f"{k}: the final state differs from the uninterrupted run's "
                               f"(max abs diff {result['max_abs_diff']:.3g})")
      except matrix.CellError as e:
        out["checks"][f"{k}_same_state"] = False
        out["errors"].append(f"{k}: {e}")
  out["checks"].update(done)
  out["errors"] += errors
  return out


def tokens_per_s(workdir: str) -> float | None:
  """The median tokens/s of a run's logged windows after the first `WARM_WINDOWS` (the first
  logged step, its compile, is never one)."""
  from train.runtime import metrics  # pylint: disable=import-outside-toplevel
  rows = sorted((r for r in metrics.read_jsonl(workdir) if "tokens_per_s" in r),
                key=lambda r: r["step"])[1 + WARM_WINDOWS:]
  return statistics.median(r["tokens_per_s"] for r in rows) if rows else None


def throughput(s: dict, wd: str) -> dict:
  """The same training run by one process driving every device of the cell and by N
  processes (module docstring): tokens/s of each and their ratio."""
  env = environment(s, deterministic=False)
  one, many = os.path.join(wd, "throughput_one"), os.path.join(wd, "throughput_processes")
  one_env = dict(env)
  if s["gpus"]:
    one_env["CUDA_VISIBLE_DEVICES"] = ",".join(s["gpus"])
  else:
    one_env["XLA_FLAGS"] = launcher.with_host_devices(env.get("XLA_FLAGS", ""), s["devices"])
  cmd = [sys.executable, "-m", "train.main", *train_flags(s, one, throughput=True)]
  cli_run.run(cmd, one + ".log", s["timeout"], "one process", **one_env)
  job = start(s, train_flags(s, many, throughput=True), env, many + "_logs")
  ended = job.wait(timeout_s=s["timeout"])
  if any(e.returncode for e in ended):
    raise RuntimeError(f"the {s['processes']} processes failed:\n" + job.output(0)[-3000:])
  a, b = tokens_per_s(one), tokens_per_s(many)
  return {"one_process_tokens_per_s": a, "processes_tokens_per_s": b,
          "ratio": b / a if a and b else None, "per_gpu_tokens_per_s": (
              b / s["devices"] if b else None), "config": s["throughput_config"]}


def run_cell(s: dict, wd: str, parts: list[str]) -> dict:
  """One cell (module docstring) in the workdir `wd` (emptied first)."""
  shutil.rmtree(wd, ignore_errors=True)
  os.makedirs(wd)
  cell = {"processes": s["processes"], "gpus": len(s["gpus"]), "devices": s["devices"],
          "mesh": s["mesh"], "steps": s["steps"], "isolate": s["isolate"] if s["gpus"] else None,
          "parts": sorted(parts), "checks": {}, "errors": []}
  t0 = time.time()
  if "checks" in parts:
    env = environment(s, deterministic=True)
    try:
      for stage in (lose_processes, resume_and_compare):
        found = stage(s, wd, env)
        cell["checks"].update(found.pop("checks"))
        cell["errors"] += found.pop("errors")
        cell.update(found)
        if cell["errors"]:
          break
    except (TimeoutError, OSError) as e:
      cell["errors"].append(f"{type(e).__name__}: {e}")
  if "throughput" in parts:
    try:
      cell["throughput"] = throughput(s, wd)
    except (RuntimeError, TimeoutError, OSError) as e:
      cell["errors"].append(f"throughput: {e}")
  cell["seconds"] = round(time.time() - t0, 1)
  return judge(cell)


def judge(cell: dict) -> dict:
  """`passed`: no errors, every check true, and on GPUs a throughput ratio of at least
  `MIN_RATIO` (of the parts the cell ran)."""
  ratio = (cell.get("throughput") or {}).get("ratio")
  speed = cell["gpus"] > 0 and "throughput" in cell["parts"]
  cell["passed"] = (not cell["errors"] and all(cell["checks"].values())
                    and (not speed or (ratio is not None and ratio >= MIN_RATIO)))
  return cell


def add_cell(cells: list[dict], cell: dict) -> dict:
  """Adds `cell` to `cells`, joined with an earlier one of the same processes and mesh (its
  other part, run by another call); returns the cell as it now stands."""
  key = lambda c: (c["processes"], c["devices"], c["mesh"])
  same = next((c for c in cells if key(c) == key(cell)), None)
  if same is None:
    cells.append(cell)
    return cell
  joined = judge({**same, **cell, "checks": {**same["checks"], **cell["checks"]},
                  "errors": same["errors"] + cell["errors"],
                  "parts": sorted(set(same.get("parts", [])) | set(cell["parts"])),
                  "seconds": same["seconds"] + cell["seconds"]})
  cells[cells.index(same)] = joined
  return joined


def summary(cell: dict) -> str:
  tp = cell.get("throughput") or {}
  ratio = f"{tp['ratio']:.3f}" if tp.get("ratio") else "-"
  lost = cell.get("lost_process_exit_s")
  coord = cell.get("lost_coordinator_exit_s")
  return (f"{cell['processes']} processes, {cell['devices']} devices, mesh {cell['mesh']}: "
          f"{'passed' if cell['passed'] else 'FAILED'}; lost process ends the others in "
          f"{'-' if lost is None else f'{lost:.1f} s'}, the coordinator in "
          f"{'-' if coord is None else f'{coord:.1f} s'} ({cell.get('coordinator_named_by')}); "
          f"throughput ratio {ratio}; {cell['seconds']:.0f} s")


def main(argv):
  del argv
  fl = flags.FLAGS
  unknown = [p for p in fl.parts if p not in ("checks", "throughput")]
  if unknown:
    raise app.UsageError(f"--parts: unknown {unknown}; choose from checks, throughput")
  gpus = [] if fl.smoke else launcher.host_gpus()
  s = settings(fl, gpus)
  if s["processes"] < 2:
    raise app.UsageError(f"--processes={s['processes']}: a cell needs at least 2")
  results = {"device": cli_run.device_name() if gpus else "cpu", "cells": []}
  for path in fl.merge:
    with open(path) as f:
      results["cells"] += json.load(f)["cells"]
  root = fl.workdir or tempfile.mkdtemp(prefix="twell_multiprocess_")
  cell = run_cell(s, os.path.join(root, f"p{s['processes']}_{s['mesh'].replace(',', '_')}"),
                  fl.parts)
  cell = add_cell(results["cells"], cell)
  ratios = [c["throughput"]["ratio"] for c in results["cells"]
            if (c.get("throughput") or {}).get("ratio")]
  results["throughput_ratio"] = min(ratios) if ratios else None
  if fl.out:
    with open(fl.out, "w") as f:
      json.dump(results, f, indent=1)
  print(summary(cell), flush=True)
  for error in cell["errors"]:
    print(error[-2000:], flush=True)
  if not cell["passed"]:
    sys.exit(1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
