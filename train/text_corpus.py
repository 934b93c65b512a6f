"""The offline corpus: docstrings of the Python standard library.

Every machine that runs this project has CPython's standard library, so its
docstrings are a text corpus that needs no download and no shipped file. A
document is one module, class or function docstring (at least 64 characters,
cleaned with `inspect.cleandoc`), found by parsing the sources with `ast`
(nothing is imported or executed).

Files are visited in sorted order and nodes in `ast.walk` order, so the list
is deterministic for a given Python installation (different Python patch
versions have slightly different docstrings). The split is a hash of the file
path: about 1 file in 20 goes to "validation", the rest to "train", so no file
contributes to both.

This module needs only the standard library: the TFDS builder
(`train/tfds_offline.py`) and the TFDS-free reader (`data.py`) both call
`iter_documents`, which is what makes their outputs identical.
"""

import ast
import inspect
import pathlib
import sysconfig
import zlib
from typing import Iterator

NAME = "twell_stdlib_text"
SPLITS = ("train", "validation")
MIN_CHARS = 64
_SKIP_PARTS = frozenset({"test", "tests", "idlelib", "site-packages",
                         "lib2to3", "__pycache__", "turtledemo",
                         "dist-packages"})


def _stdlib_files() -> list[tuple[str, pathlib.Path]]:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  out = []
  for path in root.rglob("*.py"):
    rel = path.relative_to(root)
    if not _SKIP_PARTS.intersection(rel.parts):
      out.append((rel.as_posix(), path))
  out.sort()
  return out


def split_of(relpath: str) -> str:
  return "validation" if zlib.crc32(relpath.encode()) % 20 == 0 else "train"


def iter_documents(split: str) -> Iterator[tuple[str, str]]:
  """Yields (unique key, text) for every document of `split`, in a fixed order."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r} must be one of {SPLITS}")
  for rel, path in _stdlib_files():
    if split_of(rel) != split:
      continue
    try:
      tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError):
      continue  # A few stdlib files are templates or need another grammar.
    for i, node in enumerate(ast.walk(tree)):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                           ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=False)
        if doc:
          doc = inspect.cleandoc(doc)
          if len(doc) >= MIN_CHARS:
            yield f"{rel}:{i}", doc
