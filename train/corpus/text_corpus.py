"""The offline corpora: the Python sources every machine that runs this project has.

No dataset can be downloaded, and CPython's standard library (with the installed packages)
is text that needs no download and no shipped file:

* `twell_stdlib_text` (`NAME`): docstrings. A document is one module, class or function
  docstring (at least 64 characters, cleaned with `inspect.cleandoc`), found by parsing the
  sources with `ast` (nothing is imported or executed). About 1.3 MB: tests and examples.
* `twell_python_source` (`SOURCE_NAME`): source files. A document is one `.py` file of the
  standard library, tests included (about 32 MB), as UTF-8 text.
* `twell_python_source_site` (`SITE_NAME`): the same plus the `.py` files of the
  interpreter's installed packages (site-packages; its size depends on what is installed:
  `fingerprint` records it). Files over `MAX_SOURCE_BYTES` (generated tables) are skipped.

The source corpora hold out 1 file in `SOURCE_HOLDOUT` for "validation" (by a hash of
the file's path), so no file contributes to both splits.

Files are visited in sorted order and nodes in `ast.walk` order, so the list
is deterministic for a given Python installation (different Python patch
versions have slightly different docstrings). The split is a hash of the file
path: about 1 file in 20 goes to "validation", the rest to "train", so no file
contributes to both.

This module needs only the standard library: the TFDS builder
(`tfds_offline.py`) and the TFDS-free reader (`data.py`) both call
`iter_documents`, which is what makes their outputs identical.
"""

import ast
import hashlib
import inspect
import pathlib
import sysconfig
import zlib
from typing import Iterator

NAME = "twell_stdlib_text"
SOURCE_NAME = "twell_python_source"
SITE_NAME = "twell_python_source_site"
CORPORA = (NAME, SOURCE_NAME, SITE_NAME)
SPLITS = ("train", "validation")
SOURCE_HOLDOUT = 50
MAX_SOURCE_BYTES = 1 << 20
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


def _source_files(site: bool) -> list[tuple[str, pathlib.Path]]:
  """(key, path) of every .py file of the standard library (and of site-packages), sorted."""
  paths = sysconfig.get_paths()
  roots = [("stdlib", pathlib.Path(paths["stdlib"]))]
  if site:
    roots += [("site", pathlib.Path(paths["purelib"]))]
    if paths["platlib"] != paths["purelib"]:
      roots += [("plat", pathlib.Path(paths["platlib"]))]
  out = []
  for tag, root in roots:
    for path in root.rglob("*.py"):
      rel = path.relative_to(root)
      if "__pycache__" in rel.parts or (tag == "stdlib" and (
          "site-packages" in rel.parts or "dist-packages" in rel.parts)):
        continue
      out.append((f"{tag}/{rel.as_posix()}", path))
  out.sort()
  return out


def _source_split(key: str) -> str:
  return "validation" if zlib.crc32(key.encode()) % SOURCE_HOLDOUT == 0 else "train"


def _iter_sources(split: str, site: bool) -> Iterator[tuple[str, str]]:
  for key, path in _source_files(site):
    if _source_split(key) != split:
      continue
    try:
      if path.stat().st_size > MAX_SOURCE_BYTES:
        continue
      text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
      continue  # A broken link or an unreadable file.
    if text.strip():
      yield key, text


def fingerprint(name: str, split: str) -> dict:
  """{"documents", "bytes", "sha256"} of a corpus split (its UTF-8 text, in order): what a
  result was measured on."""
  h, n, size = hashlib.sha256(), 0, 0
  for key, text in iter_documents(split, name):
    data = text.encode()
    h.update(key.encode() + b"\0" + data + b"\0")
    n, size = n + 1, size + len(data)
  return {"name": name, "split": split, "documents": n, "bytes": size,
          "sha256": h.hexdigest()}


def iter_documents(split: str, name: str = NAME) -> Iterator[tuple[str, str]]:
  """Yields (unique key, text) for every document of `split` of corpus `name`, in a fixed
  order."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r} must be one of {SPLITS}")
  if name not in CORPORA:
    raise ValueError(f"corpus {name!r} is not one of {CORPORA}")
  if name != NAME:
    yield from _iter_sources(split, site=name == SITE_NAME)
    return
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
