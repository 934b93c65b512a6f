"""Training runs as a user types them: `python -m train.main` commands, timed whole.

Shared by the benchmarks that measure what a user gets from a run (`benchmarks.time_to_quality`,
`benchmarks.whole_run`): the offline corpus and tokenizer flags, one command with its own
workdir and an empty compilation cache (a first run on a machine), its wall-clock from start
to exit, and the device's name without starting JAX in this process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time

# The repository root (benchmarks/common/ is two folders below it).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TOKENIZER = "~/.cache/twell_jax/tokenizers/python_source_site_32k"
DEFAULT_DATASET = "twell_python_source_site"


# The code a training run executes: a run's `code_digest` covers these folders' Python files.
CODE_DIRS = ("pallas_kernels", "twell_jax", "train", "configs")


def code_digest(root: str = ROOT) -> str:
  """12 hex digits of a SHA-256 over the Python files of `CODE_DIRS` (their paths and bytes,
  in sorted order): the version of the code a run measured, where no git history travels
  with the working tree (a device machine's copy). Docs, tests and benchmarks do not count."""
  h = hashlib.sha256()
  for folder in CODE_DIRS:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
      for name in sorted(f for f in filenames if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        with open(path, "rb") as f:
          h.update(os.path.relpath(path, root).encode() + b"\0" + f.read() + b"\0")
  return h.hexdigest()[:12]


def tokenizer_record(path: str, dataset: str) -> dict | None:
  """The SentencePiece model at `path`.model, trained offline on `dataset` if missing
  (`train.corpus.build_tokenizer`); a `path` ending in .model is taken as it is; None for
  "byte"."""
  if path == "byte":
    return None
  if path.endswith(".model"):
    from train.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
    size = tokenizer_lib.SentencePieceTokenizer(os.path.expanduser(path)).vocab_size
    return {"model": os.path.abspath(os.path.expanduser(path)),
            "options": {"vocab_size": size}}
  from train.corpus import build_tokenizer  # pylint: disable=import-outside-toplevel
  print(f"tokenizer: {path}.model (trained on {dataset} if missing)", flush=True)
  return build_tokenizer.build(path, dataset=dataset)


def data_flags(dataset: str, tokenizer: dict | None) -> list[str]:
  """`train.main` flags reading the offline `dataset` with `tokenizer` (None: bytes)."""
  out = [f"--config.data.dataset={dataset}", "--config.data.use_tfds=False"]
  if tokenizer is None:
    return out + ["--config.data.tokenizer=byte"]
  return out + ["--config.data.tokenizer=sentencepiece",
                f"--config.data.spm_model={tokenizer['model']}",
                f"--config.model.vocab_size={tokenizer['options']['vocab_size']}"]


def command(workdir: str, config: str, flags: list[str], fresh: bool = True) -> list[str]:
  """The `train.main` command of a run in `workdir` (emptied first, unless not `fresh`: a run
  to continue) whose compiled programs go to an empty cache of its own: a cache shared between
  runs would hand the first run's compiles to the others."""
  if fresh and os.path.exists(workdir):
    shutil.rmtree(workdir)
  return [sys.executable, "-m", "train.main", f"--config={config}", f"--workdir={workdir}",
          f"--config.compilation_cache_dir={os.path.join(workdir, 'jax_cache')}", *flags]


def environment(**extra: str) -> dict:
  return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
          **extra}


def start(cmd: list[str], log_path: str, root: str = ROOT,
          **env: str) -> tuple[subprocess.Popen, float]:
  """Starts `cmd` from `root` (default this repository's) with its output to `log_path`:
  (process, start time). Wait with `finish` or `wait_all`."""
  os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
  log = open(log_path, "w")   # pylint: disable=consider-using-with  # closed by finish
  proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                          env={**environment(**env), "PYTHONPATH": root + os.pathsep
                               + os.environ.get("PYTHONPATH", "")})
  proc.log = log
  return proc, time.time()


def wait_all(started: list[tuple[subprocess.Popen, float]], timeout: float) -> list[float]:
  """Waits for `start`ed commands running at once; each one's wall-clock seconds, from its
  start to its own exit (seen within 0.1 s)."""
  ends = [None] * len(started)
  while any(e is None for e in ends):
    for i, (proc, t0) in enumerate(started):
      if ends[i] is None and (proc.poll() is not None or time.time() - t0 > timeout):
        ends[i] = time.time()
    time.sleep(0.1)
  return [end - t0 for end, (_, t0) in zip(ends, started)]


def finish(proc: subprocess.Popen, t0: float, timeout: float, name: str,
           wall: float | None = None) -> float:
  """Waits for a `start`ed command; its wall-clock seconds (`wall` when `wait_all` measured
  it). RuntimeError with the end of its log if it failed or ran past `timeout` seconds (then
  killed)."""
  try:
    proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  wall = time.time() - t0 if wall is None else wall
  proc.log.close()
  if proc.returncode:
    with open(proc.log.name) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"{name}: train.main exited {proc.returncode} after {wall:.0f} s:\n"
                       + tail)
  return wall


def run(cmd: list[str], log_path: str, timeout: float, name: str, **env: str) -> float:
  """`start` then `finish`: the command's wall-clock seconds."""
  proc, t0 = start(cmd, log_path, **env)
  return finish(proc, t0, timeout, name)


def device_name() -> str:
  """The first GPU's name from nvidia-smi ("cpu" without one): this process never starts JAX
  on the device, which the runs it starts need whole."""
  names = gpu_names()
  return names[0] if names else "cpu"


def gpu_names() -> list[str]:
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return out.strip().splitlines()
