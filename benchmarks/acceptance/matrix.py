r"""The GPU acceptance matrix: the CLIs run as a user runs them, on every mesh the machine has.

    python -m benchmarks.acceptance.matrix --out=matrix.json                # every cell, then the shapes
    python -m benchmarks.acceptance.matrix --configs=tiny --impls=default --meshes=1 --shapes=   # one cell

A cell is (config, FFN implementation, mesh). Meshes: "1" (one GPU), and with N > 1 devices
"data=N", "fsdp=N" and, where N = 2k with k > 1, "data=2,fsdp=k". Each cell runs, through the
command lines of the README, in its own workdir:

  1. `train.main` twice at once: uninterrupted (WORKDIR/ref) and a copy (WORKDIR/run) that is
     SIGKILLed as soon as its first checkpoint is committed;
  2. `train.main` again on WORKDIR/run: it must resume from that checkpoint and finish;
  3. the train states of both runs' last checkpoints compared array by array (`same_state`:
     bit-identical; XLA's deterministic reductions are on, `--xla_gpu_deterministic_ops`);
  4. `train.evaluate`, `train.generate` and `train.export_hf` on WORKDIR/run, at once.

A cell passes when every command exits 0, the run resumed, and the states are equal; a passed
cell's checkpoints are then deleted (its logs stay). One-GPU cells run side by side, `--parallel`
per GPU (`CUDA_VISIBLE_DEVICES`), then the several-GPU cells, `--parallel` at a time: the
runs are short, so most of a cell is compiling, which overlaps.
The runs are short (`STEPS` steps on the offline corpus with the byte tokenizer), long enough
for two checkpoints and the per-layer choice's first decision.

Then `benchmarks.sweeps.shapes` (the kernels at public model shapes) runs, unless `--shapes=`.
Output: `{"device", "devices", "cells": [{"name", "ok", "error", "seconds", ...}],
"shapes": [...]}`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from benchmarks.common import cli_run
from benchmarks.acceptance import kill_resume
from train.state import checkpointing

CONFIGS = ("tiny", "small", "paper_0p5b")
IMPLS = ("default", "mosaic_gpu")
STEPS, EVERY = 12, 4
# Per config: the overrides that make a short run of it (a batch of seq_len-long rows).
SHORT = {
    "tiny": ["--config.model.dtype=bfloat16"],
    "small": ["--config.batch_size=16", "--config.data.seq_len=512"],
    # Two micro-batches of 8 a step: the accumulation the paper configs run (8 of 32).
    "paper_0p5b": ["--config.batch_size=16", "--config.grad_accum_steps=2",
                   "--config.data.dataset=twell_stdlib_text", "--config.data.tokenizer=byte"],
}
# The 1.5B and 2B configs (28 and 38 layers, fsdp over every device, remat): the same short run
# on several GPUs (`--configs=paper_1p5b,paper_2b --meshes=fsdp`, plus `data=2,fsdp=N/2` on N
# GPUs for data=2 x fsdp=N/2; not in `CONFIGS`). A checkpoint of each holds 18-24 GB, so each
# run keeps one: the killed run resumes from it, and the last one is compared (a save writes the
# new checkpoint before it deletes the old: 2 x 2 x 24 GB at the most, within a 2-GPU machine's
# 128 GB disk).
SHORT["paper_1p5b"] = SHORT["paper_2b"] = SHORT["paper_0p5b"] + ["--config.keep_checkpoints=1"]
# Cells whose workdirs hold ~100 GB run one at a time, after the others: two at once could fill
# a node's disk.
ONE_AT_A_TIME = ("paper_1p5b", "paper_2b")
# Two checkpoints kept (`SHORT` may override): the one the killed run resumes from and the last
# (a paper_0p5b checkpoint holds 6 GB of parameters and AdamW state).
COMMON = [f"--config.num_train_steps={STEPS}", f"--config.checkpoint_every={EVERY}",
          "--config.keep_checkpoints=2", f"--config.eval_every={STEPS}",
          "--config.eval_batches=2", f"--config.log_every={EVERY}",
          f"--config.layer_choice.every={EVERY}", "--config.layer_choice.background=False"]


def meshes(n: int) -> list[str]:
  if n == 1:
    return ["1"]
  out = [f"data={n}", f"fsdp={n}"]
  if n % 2 == 0 and n > 2:
    out.append(f"data=2,fsdp={n // 2}")
  return out


def select_meshes(available: list[str], wanted: list[str]) -> list[str]:
  """The meshes of `available` that `wanted` (the --meshes flag, split at commas) names: by
  kind (the axis before "=": "data" also takes "data=2,fsdp=2"), whole ("data=4"), or by each
  of its axes ("data=2", "fsdp=2" take "data=2,fsdp=2"). ValueError naming the entries that
  select nothing (a mesh this machine does not have), rather than running fewer cells."""
  chosen = [m for m in available
            if m.split("=")[0] in wanted or all(part in wanted for part in m.split(","))]
  used = {part for m in chosen for part in m.split(",")} | {m.split("=")[0] for m in chosen}
  unknown = [w for w in wanted if w not in used]
  if unknown:
    raise ValueError(f"--meshes {','.join(unknown)}: not among this machine's meshes "
                     f"{available}")
  return chosen


def split_cells(cells):
  """(cells run `--parallel` at a time, cells run one at a time after them: `ONE_AT_A_TIME`)
  of (config, impl, mesh) cells."""
  return ([c for c in cells if c[0] not in ONE_AT_A_TIME],
          [c for c in cells if c[0] in ONE_AT_A_TIME])


def mesh_flags(mesh: str) -> list[str]:
  if mesh == "1":
    return ["--config.mesh.data=1", "--config.mesh.fsdp=1"]
  axes = dict(kv.split("=") for kv in mesh.split(","))
  return [f"--config.mesh.data={axes.get('data', 1)}", f"--config.mesh.fsdp={axes.get('fsdp', 1)}"]


def train_cmd(config: str, impl: str, mesh: str, workdir: str) -> list[str]:
  cmd = [sys.executable, "-m", "train.main", f"--config=configs/{config}.py",
         f"--workdir={workdir}", *COMMON, *SHORT[config], *mesh_flags(mesh)]
  if impl != "default":
    cmd.append(f"--config.model.ffn_implementation={impl}")
  return cmd


def _env(gpus: str | None) -> dict:
  env = kill_resume.deterministic_env()
  # Several processes share each GPU: each takes memory as it needs it.
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env.pop("JAX_PLATFORMS", None)
  if gpus is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpus
  return env


def _tail(path: str, n: int = 1500) -> str:
  try:
    with open(path, errors="replace") as f:
      text = f.read()
  except OSError:
    return ""
  lines = [l for l in text.splitlines() if "xla_bridge" not in l and "libtpu" not in l]
  return "\n".join(lines)[-n:]


class CellError(Exception):
  pass


def _run(cmd, env, log, timeout) -> None:
  with open(log, "w") as f:
    p = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
  if p.returncode:
    raise CellError(f"{' '.join(cmd[2:4])} exited {p.returncode}:\n{_tail(log)}")


def run_tools(run: str, wd: str, env: dict, timeout: int) -> tuple[dict, list[str]]:
  """`train.evaluate`, `train.generate` and `train.export_hf` on the workdir `run`, at once,
  one process each (logs, the generation JSON and the export under `wd`): ({tool: whether it
  exited 0}, the failures' messages)."""
  tools = {
      "evaluate": [sys.executable, "-m", "train.evaluate", f"--workdir={run}"],
      "generate": [sys.executable, "-m", "train.generate", f"--workdir={run}",
                   "--prompt=def ", "--max_new_tokens=16", "--temperature=0",
                   f"--out={os.path.join(wd, 'generate.json')}"],
      "export_hf": [sys.executable, "-m", "train.export_hf", f"--workdir={run}",
                    f"--out={os.path.join(wd, 'hf')}"],
  }
  done, errors = {}, []
  with concurrent.futures.ThreadPoolExecutor(len(tools)) as pool:
    futures = {k: pool.submit(_run, cmd, env, os.path.join(wd, f"{k}.log"), timeout)
               for k, cmd in tools.items()}
    for k, fut in futures.items():
      try:
        fut.result()
        done[k] = True
      except (CellError, subprocess.TimeoutExpired) as e:
        done[k] = False
        errors.append(f"{k}: {e}")
  return done, errors


def compare_states(a: str, b: str) -> dict:
  """Train states of the last checkpoints of workdirs a and b, compared on the CPU (a
  subprocess: this process keeps off the GPUs)."""
  code = (
      "import json, sys, jax, numpy as np\n"
      "from benchmarks.acceptance import kill_resume\n"
      "from train.state import checkpointing\n"
      "a, b = sys.argv[1:3]\n"
      "step = max(checkpointing.steps_on_disk(a))\n"
      "print(json.dumps(dict(step=step, **kill_resume.compare("
      "kill_resume.state(a, step), kill_resume.state(b, step)))))\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
  env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
  p = subprocess.run([sys.executable, "-c", code, a, b], env=env, capture_output=True,
                     text=True, timeout=600)
  if p.returncode:
    raise CellError(f"comparing the states failed:\n{p.stderr[-1500:]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


def _train_and_kill(config: str, impl: str, mesh: str, wd: str, env: dict,
                    timeout: int) -> int:
  """Trains the cell twice side by side, an uninterrupted run (wd/ref) and one SIGKILLed after
  its first checkpoint (wd/run); returns the step the killed run's last checkpoint holds."""
  ref, run = os.path.join(wd, "ref"), os.path.join(wd, "run")
  with open(os.path.join(wd, "ref.log"), "w") as f_ref, \
       open(os.path.join(wd, "killed.log"), "w") as f_run:
    p_ref = subprocess.Popen(train_cmd(config, impl, mesh, ref), env=env, stdout=f_ref,
                             stderr=subprocess.STDOUT)
    p_run = subprocess.Popen(train_cmd(config, impl, mesh, run), env=env, stdout=f_run,
                             stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while (not checkpointing.steps_on_disk(run) and p_run.poll() is None
           and time.time() < deadline):
      time.sleep(0.05)
    p_run.send_signal(signal.SIGKILL)
    p_run.wait()
    try:
      p_ref.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      p_ref.kill()
      raise CellError("the uninterrupted run timed out")
  killed_at = max(checkpointing.steps_on_disk(run), default=None)
  if p_ref.returncode:
    raise CellError(f"the uninterrupted run exited {p_ref.returncode}:\n"
                    f"{_tail(os.path.join(wd, 'ref.log'))}")
  if killed_at is None or killed_at >= STEPS:
    raise CellError(f"the killed run was not stopped between checkpoints (checkpoints "
                    f"{checkpointing.steps_on_disk(run)}):\n"
                    f"{_tail(os.path.join(wd, 'killed.log'))}")
  return killed_at


def _check_resumed(cell: dict, wd: str, env: dict, timeout: int) -> list[str]:
  """The resumed run's evaluate, generate and export_hf commands and its state against the
  uninterrupted run's, into `cell`; returns the problems found."""
  ref, run = os.path.join(wd, "ref"), os.path.join(wd, "run")
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    same = pool.submit(compare_states, ref, run)
    done, problems = run_tools(run, wd, env, timeout)
    cmp = same.result()
  cell.update(done)
  if cell.get("generate"):
    # Which decode the CLI's defaults chose for this model (FFN per layer, attention).
    with open(os.path.join(wd, "generate.json")) as f:
      stats = json.load(f)["stats"]
    cell["decode"] = {k: stats.get(k) for k in ("decode_ffn", "decode_attention",
                                                 "decode_tokens_per_s")}
  cell["same_state"] = bool(cmp["equal"])
  cell["state_max_abs_diff"] = cmp["max_abs_diff"]
  if not cell["same_state"]:
    problems.append(f"the resumed run's state differs from the uninterrupted one's "
                    f"(max abs diff {cmp['max_abs_diff']:.3g})")
  return problems


def run_cell(config: str, impl: str, mesh: str, root: str, gpus: str | None,
             timeout: int) -> dict:
  """One cell: train, SIGKILL, resume, the same state, evaluate, generate, export."""
  name = f"{config}/{impl}/{mesh}"
  cell = {"name": name, "config": config, "impl": impl, "mesh": mesh, "ok": False,
          "error": None}
  wd = os.path.join(root, name.replace("/", "_").replace(",", "_").replace("=", ""))
  shutil.rmtree(wd, ignore_errors=True)
  os.makedirs(wd)
  t0 = time.time()
  try:
    env = _env(gpus)
    killed_at = _train_and_kill(config, impl, mesh, wd, env, timeout)
    cell["killed_after_step"] = killed_at
    cell["train_s"] = round(time.time() - t0, 1)
    log = os.path.join(wd, "resume.log")
    _run(train_cmd(config, impl, mesh, os.path.join(wd, "run")), env, log, timeout)
    cell["resumed"] = f"Resumed from checkpoint step {killed_at}" in _tail(log, 10**7)
    if not cell["resumed"]:
      raise CellError(f"the rerun did not resume from step {killed_at}:\n{_tail(log)}")
    problems = _check_resumed(cell, wd, env, timeout)
    if problems:
      raise CellError("\n".join(problems))
    cell["ok"] = True
    for d in ("ref", "run", "hf"):   # a passed cell keeps its logs only
      shutil.rmtree(os.path.join(wd, d), ignore_errors=True)
  except (CellError, subprocess.TimeoutExpired, OSError) as e:
    cell["error"] = str(e)[-3000:]
  cell["seconds"] = round(time.time() - t0, 1)
  print(f"[{time.strftime('%X')}] {name:<32} {'ok' if cell['ok'] else 'FAILED'} "
        f"({cell['seconds']:.0f} s)" + ("" if cell["ok"] else "\n" + cell["error"][-1200:]),
        flush=True)
  return cell


def write(path: str | None, result: dict) -> None:
  if path:
    with open(path + ".tmp", "w") as f:
      json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def table(results: list[dict]) -> str:
  """A markdown table of matrix results (one per machine), a row per cell."""
  lines = ["| config | FFN | mesh | device | train, kill, resume | same state | evaluate, "
           "generate, export | result |", "|---|---|---|---|---|---|---|---|"]
  yes = lambda v: "yes" if v else ("no" if v is not None else "-")
  for r in results:
    dev = f"{r['devices']} x {r['device'].replace('NVIDIA ', '')}"
    for c in r["cells"]:
      tools = c.get("evaluate"), c.get("generate"), c.get("export_hf")
      tools_text = "yes" if all(tools) else yes(None if None in tools else False)
      first = ((c["error"] or "").strip().splitlines() or [""])[0]
      result = "passes" if c["ok"] else (first.split(":")[0] if first.startswith("not ")
                                         else "fails: " + first[:80])
      lines.append(f"| {c['config']} | {c['impl']} | {c['mesh']} | {dev} | "
                   f"{yes(c.get('resumed'))} | {yes(c.get('same_state'))} | {tools_text} | "
                   f"{result.replace('|', '/')} |")
  return "\n".join(lines)


def main(argv):
  del argv
  fl = flags.FLAGS
  if fl.table:
    results = []
    for path in fl.table.split(","):
      with open(path) as f:
        results.append(json.load(f))
    print(table(results))
    return
  n = len(cli_run.gpu_names())
  if n == 0:
    sys.exit("benchmarks.acceptance.matrix needs NVIDIA GPUs (nvidia-smi lists none)")
  configs = [c for c in fl.configs.split(",") if c]
  impls = [i for i in fl.impls.split(",") if i]
  wanted = [m for m in fl.meshes.split(",") if m] if fl.meshes else None
  all_meshes = ["1"] + (meshes(n) if n > 1 else [])
  if wanted:
    try:
      all_meshes = select_meshes(all_meshes, wanted)
    except ValueError as e:
      sys.exit(str(e))
  root = fl.workdir or tempfile.mkdtemp(prefix="twell_matrix_")
  one = [(c, i, "1") for c in configs for i in impls if "1" in all_meshes]
  many = [(c, i, m) for m in all_meshes if m != "1" for c in configs for i in impls]
  result = {"device": cli_run.device_name(), "devices": n, "cells": [], "shapes": []}

  def done(cell):
    result["cells"].append(cell)
    write(fl.out, result)

  # One-GPU cells: `parallel` at a time on each GPU; then the others, `parallel` at a time.
  with concurrent.futures.ThreadPoolExecutor(n * fl.parallel) as pool:
    futures = [pool.submit(run_cell, *cell, root, str(k % n), fl.timeout)
               for k, cell in enumerate(one)]
    for fut in concurrent.futures.as_completed(futures):
      done(fut.result())
  together, alone = split_cells(many)
  with concurrent.futures.ThreadPoolExecutor(fl.parallel) as pool:
    futures = [pool.submit(run_cell, *cell, root, None, fl.timeout) for cell in together]
    for fut in concurrent.futures.as_completed(futures):
      done(fut.result())
  for cell in alone:
    done(run_cell(*cell, root, None, fl.timeout))
  result["cells"].sort(key=lambda c: (c["mesh"] != "1", c["mesh"], c["config"], c["impl"]))
  if fl.shapes:
    shapes_json = os.path.join(root, "shapes.json")
    names = "" if fl.shapes == "all" else fl.shapes
    p = subprocess.run([sys.executable, "-m", "benchmarks.sweeps.shapes", f"--out={shapes_json}",
                        f"--names={names}"], env=_env("0"), timeout=fl.timeout * 2)
    if p.returncode == 0:
      with open(shapes_json) as f:
        result["shapes"] = json.load(f)["shapes"]
  ok = sum(c["ok"] for c in result["cells"])
  print(f"{ok} of {len(result['cells'])} cells passed on {n} x {result['device']}", flush=True)
  write(fl.out, result)


if __name__ == "__main__":
  flags.DEFINE_string("configs", ",".join(CONFIGS), "configs (configs/<name>.py)")
  flags.DEFINE_string("impls", ",".join(IMPLS), "FFN implementations; default: the config's")
  flags.DEFINE_string("meshes", None, "mesh kinds to run: 1, data, fsdp, data=2,fsdp=... "
                      "(default: all the machine has)")
  flags.DEFINE_string("shapes", "all", "benchmarks.sweeps.shapes names after the cells, 'all', or "
                      "empty for none")
  flags.DEFINE_string("workdir", None, "where the cells' workdirs go (default: a temp dir)")
  flags.DEFINE_integer("timeout", 900, "seconds per command")
  flags.DEFINE_integer("parallel", 2, "cells at once per GPU (one-GPU cells) and of the "
                       "several-GPU cells (their compiles overlap)")
  flags.DEFINE_string("out", None, "write the matrix as JSON here")
  flags.DEFINE_string("table", None, "print the markdown table of these matrix JSON files "
                      "(comma-separated) and exit; no GPU needed")
  app.run(main)
