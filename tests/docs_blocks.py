"""The fenced code blocks of README.md and docs/*.md, and how the tests run them.

A block is code when its language is `python`, `bash`, `sh` or `shell`; config when it is
`yaml`, `json` or `toml`; anything else (`text`, output samples) is shown, not run.

An HTML comment on the line right above a fence tells the tests how the block runs:

    <!-- docs-test: gpu -->         needs a Hopper GPU: run by `benchmarks/gpu.sh tests`
    <!-- docs-test: gpus=N -->      needs N Hopper GPUs (a document whose blocks need more GPUs
                                    than the machine has is skipped there, saying so)
    <!-- docs-test: id=NAME -->     a dedicated test fetches it with `find("NAME")` and runs it
                                    (a cluster script under a local launcher, say)

Unmarked code blocks run on the CPU in CI (`tests/test_docs.py`), gpu blocks in its GPU
test; config blocks need an id. Markdown is parsed with markdown-it-py, so fences inside
lists and quotes count too.

How a document's blocks run (`run`): in document order, in one sandbox per document, as a
reader who pastes them one after the other would run them:

- The sandbox (`sandbox`) is a fresh directory whose top level links every top-level entry
  of the repository (`train/`, `configs/`, `benchmarks/`, ...), so commands run from the
  repository root (`python -m train.main --config=configs/tiny.py`) work there, and whatever
  a block writes lands in the sandbox, never in the checkout. Its `.venv/bin/python` (first
  on PATH) is the interpreter running the tests, so `.venv/bin/python -m ...` works as the
  README writes it.
- "/tmp/" in a block's text becomes the sandbox's own `tmp/` directory (`localize`):
  `--workdir=/tmp/twell_tiny` writes `<sandbox>/tmp/twell_tiny`, so tests running in parallel
  never share a path, and a later block of the same document finds what an earlier one wrote.
- bash blocks run with `bash -e -o pipefail`; python blocks run in one interpreter per
  document, each block in a fresh namespace, so every python block carries its own imports.
- Line numbers are the document's: a python traceback names `README.md`, line 57; a failing
  bash command prints `README.md:57: exit status 1`; the runner names the failing block.

A document that needs the offline corpus prepared finds it where the tests keep it:
`TFDS_DATA_DIR` in the environment the caller passes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time

from markdown_it import MarkdownIt

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODE = ("python", "bash", "sh", "shell")
CONFIG = ("yaml", "json", "toml")
_MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
_START, _FAILED, _DONE = "docs-block: ", "docs-block-failed: ", "docs-block-done: "


@dataclasses.dataclass(frozen=True)
class Block:
  path: str         # relative to the repository root
  line: int         # 1-based line of the opening fence
  lang: str
  code: str
  gpu: bool = False
  id: str | None = None
  gpus: int = 0     # GPUs the block needs: 1 for `gpu`, N for `gpus=N`

  @property
  def where(self) -> str:
    return f"{self.path}:{self.line}"

  @property
  def runs_here(self) -> bool:
    """Code run by the generic runner: not left to a dedicated test."""
    return self.lang in CODE and self.id is None


def doc_files() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _marker(lines: list[str], fence_line: int) -> tuple[int, str | None]:
  """(GPUs needed, id) from the comment right above the fence at 0-based `fence_line`."""
  if fence_line == 0:
    return 0, None
  m = _MARKER.search(lines[fence_line - 1])
  if not m:
    return 0, None
  gpus, ident = 0, None
  for word in m.group(1).split():
    if word == "gpu":
      gpus = max(gpus, 1)
    elif re.fullmatch(r"gpus=[1-9]\d*", word):
      gpus = int(word[5:])
    elif word.startswith("id="):
      ident = word[3:]
    else:
      raise ValueError(f"unknown docs-test word {word!r} above line {fence_line + 1}")
  return gpus, ident


def blocks(path: pathlib.Path) -> list[Block]:
  text = path.read_text()
  lines = text.splitlines()
  out = []
  for tok in MarkdownIt("commonmark").parse(text):
    if tok.type != "fence" or tok.map is None:
      continue
    lang = (tok.info.split() or [""])[0].lower()
    gpus, ident = _marker(lines, tok.map[0])
    out.append(Block(str(path.relative_to(ROOT)), tok.map[0] + 1, lang, tok.content,
                     gpus > 0, ident, gpus))
  return out


def all_blocks() -> list[Block]:
  return [b for path in doc_files() for b in blocks(path)]


def find(ident: str) -> Block:
  """The one block marked `id=ident` in README.md or docs/."""
  found = [b for b in all_blocks() if b.id == ident]
  if len(found) != 1:
    raise LookupError(f"{len(found)} doc blocks marked id={ident}")
  return found[0]


# ---- running blocks ----

def sandbox(path: pathlib.Path) -> pathlib.Path:
  """Makes the empty or new directory `path` a place to run blocks from (the module
  docstring); returns its `tmp/`, the directory "/tmp/" maps to."""
  path.mkdir(parents=True, exist_ok=True)
  for entry in ROOT.iterdir():
    if not entry.name.startswith("."):
      (path / entry.name).symlink_to(entry)
  bin_dir = path / ".venv" / "bin"
  bin_dir.mkdir(parents=True)
  for name in ("python", "python3"):    # scripts, not links: a venv's python finds its
    (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')   # site there
    (bin_dir / name).chmod(0o755)
  tmp = path / "tmp"
  tmp.mkdir()
  return tmp


def localize(code: str, tmp: pathlib.Path) -> str:
  """`code` with "/tmp/" pointing into the private directory `tmp`."""
  return code.replace("/tmp/", f"{tmp}/")


@dataclasses.dataclass
class Run:
  returncode: int
  output: str                  # stdout and stderr together
  failed: str | None           # the failing block's `where`, if one failed
  seconds: dict[str, tuple[float, float]]   # where -> (wall, CPU incl. child processes)


def run(code_blocks: list[Block], directory: pathlib.Path, env: dict | None = None,
        timeout: float = 600) -> Run:
  """Runs `code_blocks` in order in a sandbox made in `directory` (module docstring)."""
  tmp = sandbox(directory)
  spec = [dict(where=b.where, path=b.path, line=b.line, lang=b.lang,
               code=localize(b.code, tmp)) for b in code_blocks]
  env = dict(os.environ if env is None else env)
  env["PATH"] = f"{directory / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
  proc = subprocess.run([sys.executable, __file__], input=json.dumps(spec), cwd=directory,
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        timeout=timeout, check=False)
  failed = [l[len(_FAILED):] for l in proc.stdout.splitlines() if l.startswith(_FAILED)]
  seconds = {}
  for line in proc.stdout.splitlines():
    if line.startswith(_DONE):
      where, wall, cpu = line[len(_DONE):].split()
      seconds[where] = (float(wall), float(cpu))
  if proc.returncode and not failed:     # died outside a block: name the last one started
    started = [l[len(_START):].split()[0] for l in proc.stdout.splitlines()
               if l.startswith(_START)]
    failed = started[-1:] or ["(before the first block)"]
  return Run(proc.returncode, proc.stdout, failed[0] if failed else None, seconds)


def _cpu_seconds() -> float:
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


def _run_one(block: dict) -> bool:
  """Runs one block of the spec `run` wrote, in this process's sandbox; False if it failed."""
  pad = "\n" * block["line"]          # the first line of code is the fence's line + 1
  if block["lang"] == "python":
    try:
      exec(compile(pad + block["code"], block["path"], "exec"),  # pylint: disable=exec-used
           {"__name__": "__main__"})
    except BaseException:   # pylint: disable=broad-except
      import traceback  # pylint: disable=import-outside-toplevel
      traceback.print_exc()
      return False
    return True
  script = ("trap 'echo \"$0:$LINENO: exit status $?\" >&2' ERR" + pad[1:] + "\n"
            + block["code"])
  proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script, block["path"]],
                        check=False)
  return proc.returncode == 0


def _main() -> int:
  sys.path.insert(0, os.getcwd())     # python blocks import from the sandbox, as `python` would
  for block in json.load(sys.stdin):
    print(f"{_START}{block['where']} {block['lang']}", flush=True)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    ok = _run_one(block)
    sys.stdout.flush()
    sys.stderr.flush()
    if not ok:
      print(f"{_FAILED}{block['where']}", flush=True)
      return 1
    print(f"{_DONE}{block['where']} {time.perf_counter() - wall:.2f} "
          f"{_cpu_seconds() - cpu:.2f}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(_main())
