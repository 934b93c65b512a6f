"""The fenced code blocks of README.md and docs/*.md, for the tests that run them.

A block is code when its language is `python`, `bash`, `sh` or `shell`; config when it is
`yaml`, `json` or `toml`; anything else (`text`, output samples) is shown, not run.

An HTML comment on the line right above a fence tells the tests how the block runs:

    <!-- docs-test: gpu -->         needs a Hopper GPU: run by `benchmarks/gpu.sh tests`
    <!-- docs-test: id=NAME -->     a dedicated test fetches it with `find("NAME")` and runs it
                                    (a cluster script under a local launcher, say)

Unmarked code blocks run on the CPU in CI (`tests/test_docs.py`). Config blocks need an id.
Markdown is parsed with markdown-it-py, so fences inside lists and quotes count too.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

from markdown_it import MarkdownIt

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODE = ("python", "bash", "sh", "shell")
CONFIG = ("yaml", "json", "toml")
_MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")


@dataclasses.dataclass(frozen=True)
class Block:
  path: str         # relative to the repository root
  line: int         # 1-based line of the opening fence
  lang: str
  code: str
  gpu: bool = False
  id: str | None = None

  @property
  def where(self) -> str:
    return f"{self.path}:{self.line}"


def doc_files() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _marker(lines: list[str], fence_line: int) -> tuple[bool, str | None]:
  """(gpu, id) from the comment right above the fence at 0-based `fence_line`."""
  if fence_line == 0:
    return False, None
  m = _MARKER.search(lines[fence_line - 1])
  if not m:
    return False, None
  gpu, ident = False, None
  for word in m.group(1).split():
    if word == "gpu":
      gpu = True
    elif word.startswith("id="):
      ident = word[3:]
    else:
      raise ValueError(f"unknown docs-test word {word!r} above line {fence_line + 1}")
  return gpu, ident


def blocks(path: pathlib.Path) -> list[Block]:
  text = path.read_text()
  lines = text.splitlines()
  out = []
  for tok in MarkdownIt("commonmark").parse(text):
    if tok.type != "fence" or tok.map is None:
      continue
    lang = (tok.info.split() or [""])[0].lower()
    gpu, ident = _marker(lines, tok.map[0])
    out.append(Block(str(path.relative_to(ROOT)), tok.map[0] + 1, lang, tok.content, gpu,
                     ident))
  return out


def all_blocks() -> list[Block]:
  return [b for path in doc_files() for b in blocks(path)]


def find(ident: str) -> Block:
  """The one block marked `id=ident` in README.md or docs/."""
  found = [b for b in all_blocks() if b.id == ident]
  if len(found) != 1:
    raise LookupError(f"{len(found)} doc blocks marked id={ident}")
  return found[0]
