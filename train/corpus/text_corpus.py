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

Held-out split, by content: a document goes to "validation" when a hash of its text (white
space collapsed, `content_key`) falls in 1 of `HOLDOUT` buckets (20 for the docstrings, 50 for
the sources), else to "train"; each split keeps only the first document of each content key.
Identical texts at different paths (a package vendored twice, the same docstring on two
methods) therefore land in one split, once: no held-out text is trained on.

Files are visited in sorted order and nodes in `ast.walk` order, so the list is deterministic
for a given Python installation (different Python patch versions have slightly different
docstrings).

This module needs only the standard library: the TFDS builder (`tfds_offline.py`) reads
`iter_documents` and the TFDS-free reader (`train/data/pipeline.py`) `document_files` (the
source corpora) or `documents` (the docstrings), the same documents in the same order, which
is what makes their outputs identical.
"""

import ast
import functools
import hashlib
import inspect
import json
import os
import pathlib
import sys
import sysconfig
import tempfile
from typing import Iterator

NAME = "twell_stdlib_text"
SOURCE_NAME = "twell_python_source"
SITE_NAME = "twell_python_source_site"
CORPORA = (NAME, SOURCE_NAME, SITE_NAME)
SPLITS = ("train", "validation")
HOLDOUT = {NAME: 20, SOURCE_NAME: 50, SITE_NAME: 50}   # 1 document in N is held out
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


@functools.cache
def _source_files(site: bool, /) -> tuple[tuple[str, pathlib.Path], ...]:
  """(key, path) of every .py file of the standard library (and of site-packages), sorted;
  listed once per process (positional only: the cache tells `f(x)` from `f(site=x)`)."""
  paths = sysconfig.get_paths()
  roots = [("stdlib", pathlib.Path(paths["stdlib"]))]
  if site:
    roots += [("site", pathlib.Path(paths["purelib"]))]
    if paths["platlib"] != paths["purelib"]:
      roots += [("plat", pathlib.Path(paths["platlib"]))]
  out = []
  for tag, root in roots:
    prefix = len(str(root)) + 1
    for path in root.rglob("*.py"):
      # rglob yields root / rel: the path past the root's is rel (Path.relative_to, which
      # costs a second per 10k files, is not needed).
      parts = str(path)[prefix:].split(os.sep)
      if "__pycache__" in parts or (tag == "stdlib" and (
          "site-packages" in parts or "dist-packages" in parts)):
        continue
      out.append((f"{tag}/{'/'.join(parts)}", path))
  out.sort()
  return tuple(out)


def content_key(text: str) -> bytes:
  """What makes two documents the same: a digest of the text with its white space collapsed
  (a copy re-indented or with other line endings is the same document)."""
  return hashlib.blake2b(" ".join(text.split()).encode(), digest_size=16).digest()


def split_of(key: bytes, name: str) -> str:
  """The split of a document whose `content_key` is `key` in corpus `name`."""
  return "validation" if int.from_bytes(key[:8], "little") % HOLDOUT[name] == 0 else "train"


def _read_source(path: pathlib.Path) -> str | None:
  """A source file's text; None for one over `MAX_SOURCE_BYTES`, unreadable (a broken link)
  or blank."""
  try:
    if path.stat().st_size > MAX_SOURCE_BYTES:
      return None
    text = path.read_bytes().decode("utf-8", errors="replace")
  except OSError:
    return None
  return text if text.strip() else None


def _iter_sources(site: bool) -> Iterator[tuple[str, str]]:
  for key, path in _source_files(site):
    text = _read_source(path)
    if text is not None:
      yield key, text


def fingerprint(name: str, split: str) -> dict:
  """{"documents", "bytes", "sha256"} of a corpus split (its UTF-8 text, in order): what a
  result was measured on. Reading a corpus of sources takes seconds (10-15 for the site
  corpus), so it is kept in the corpus cache (`CACHE_DIR`), keyed by the corpus's files, their
  sizes and modification times, and this module's own code."""
  _check(split, name)
  path = _fingerprint_path(name, split)
  if path is not None:
    try:
      with open(path, encoding="utf-8") as f:
        return json.load(f)
    except (OSError, ValueError):
      pass    # not there yet, or unreadable: read the corpus, and write it again
  h, n, size = hashlib.sha256(), 0, 0
  for key, text in iter_documents(split, name):
    data = text.encode()
    h.update(key.encode() + b"\0" + data + b"\0")
    n, size = n + 1, size + len(data)
  out = {"name": name, "split": split, "documents": n, "bytes": size, "sha256": h.hexdigest()}
  if path is not None:
    _write_cache(path, out)
  return out


def _corpus_files(name: str) -> tuple[tuple[str, pathlib.Path], ...]:
  """(key, path) of every file corpus `name` is made from."""
  return tuple(_stdlib_files()) if name == NAME else _source_files(name == SITE_NAME)


def _corpus_cache_file(stem: str, name: str) -> pathlib.Path | None:
  """Cache file `stem`-<digest>.json of something read off corpus `name` (None: caching
  off), the digest of what it is made from (every file of the corpus: path, size,
  modification time) and of how (this module's source, the Python version)."""
  return _keyed_cache_file(stem, _corpus_files(name),
                           pathlib.Path(__file__).read_bytes() + sys.version.encode())


def _fingerprint_path(name: str, split: str) -> pathlib.Path | None:
  """The cache file of a split's `fingerprint`, or None (caching off)."""
  return _corpus_cache_file(f"fingerprint-{name}-{split}", name)


def _check(split: str, name: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split={split!r} must be one of {SPLITS}")
  if name not in CORPORA:
    raise ValueError(f"corpus {name!r} is not one of {CORPORA}")


def _iter_split_documents(name: str) -> Iterator[tuple[str, str, str]]:
  """(split, key, text) of every document of corpus `name` in a fixed order, the first of
  each content only (a content key falls in one split: module docstring)."""
  seen = set()
  for key, text in _iter_all(name):
    ck = content_key(text)
    if ck not in seen:
      seen.add(ck)
      yield split_of(ck, name), key, text


def iter_documents(split: str, name: str = NAME) -> Iterator[tuple[str, str]]:
  """Yields (unique key, text) for every document of `split` of corpus `name`, in a fixed
  order: the first of each content (module docstring). Streams: nothing is kept."""
  _check(split, name)
  for where, key, text in _iter_split_documents(name):
    if where == split:
      yield key, text


# Per corpus, the keys of each split's documents in order (`split_keys`), once known to this
# process.
_SPLIT_KEYS: dict[str, dict[str, tuple[str, ...]]] = {}


def _known_split_keys(name: str) -> dict[str, tuple[str, ...]] | None:
  """`split_keys(name)` if this process or the corpus cache knows them, else None."""
  keys = _SPLIT_KEYS.get(name)
  if keys is None and name != NAME:   # the docstring corpus's own cache holds it whole
    path = _corpus_cache_file(f"splits-{name}", name)
    if path is not None:
      try:
        with open(path, encoding="utf-8") as f:
          saved = json.load(f)
        keys = {s: tuple(str(k) for k in saved[s]) for s in SPLITS}
      except (OSError, ValueError, TypeError, KeyError):
        return None   # not there yet, or unreadable: read the corpus, and write it again
      _SPLIT_KEYS[name] = keys
  return keys


def _remember_split_keys(name: str, keys: dict) -> dict[str, tuple[str, ...]]:
  keys = _SPLIT_KEYS[name] = {s: tuple(keys[s]) for s in SPLITS}
  path = None if name == NAME else _corpus_cache_file(f"splits-{name}", name)
  if path is not None:
    _write_cache(path, {s: list(k) for s, k in keys.items()})
  return keys


def split_keys(name: str = NAME) -> dict[str, tuple[str, ...]]:
  """Per split, the keys of its documents in `iter_documents` order. Which split a document
  is in takes reading and hashing every file of the corpus (seconds: ~400 MB for the site
  corpus), so for the source corpora the answer is kept in the corpus cache, keyed like
  `fingerprint`: a process that finds it there opens a split without reading it
  (`document_files`)."""
  _check("train", name)
  keys = _known_split_keys(name)
  if keys is None:
    keys = {s: [] for s in SPLITS}
    for where, key, _ in _iter_split_documents(name):
      keys[where].append(key)
    keys = _remember_split_keys(name, keys)
  return keys


def documents(split: str, name: str = NAME) -> tuple[tuple[str, str], ...]:
  """`iter_documents(split, name)` as a tuple. Where the splits' keys are not known yet
  (`split_keys`), one pass reads and hashes every document and keeps them (not the texts);
  else only the split's own files are read."""
  _check(split, name)
  keys = _known_split_keys(name)
  if keys is None:
    keys, out = {s: [] for s in SPLITS}, []
    for where, key, text in _iter_split_documents(name):
      keys[where].append(key)
      if where == split:
        out.append((key, text))
    _remember_split_keys(name, keys)
    return tuple(out)
  if name == NAME:
    texts = dict(_docstrings())
    return tuple((k, texts[k]) for k in keys[split])
  paths = dict(_source_files(name == SITE_NAME))
  read = ((k, _read_source(paths[k])) for k in keys[split])
  return tuple((k, text) for k, text in read if text is not None)


class DocumentFiles:
  """One split of a source corpus read on demand: `len()` documents, `get_many(indices)`
  their texts. Opening it reads no document (with the splits' keys cached, `split_keys`), and
  a run reads only the documents it trains on."""

  def __init__(self, paths):
    self._paths = tuple(paths)

  def __len__(self) -> int:
    return len(self._paths)

  def get_many(self, indices) -> list[str]:
    out = []
    for i in indices:
      text = _read_source(self._paths[i])
      if text is None:
        raise OSError(f"{self._paths[i]}: a document of the corpus is gone or now blank or "
                      f"over {MAX_SOURCE_BYTES} bytes; its files changed after the run "
                      "opened it (restart the run to read the corpus as it is now)")
      out.append(text)
    return out


def document_files(split: str, name: str) -> DocumentFiles:
  """Split `split` of source corpus `name` (`SOURCE_NAME`, `SITE_NAME`) as `DocumentFiles`:
  the documents of `iter_documents(split, name)`, in that order."""
  _check(split, name)
  if name == NAME:
    raise ValueError(f"{NAME} is parsed from the sources, not read from files: use documents()")
  paths = dict(_source_files(name == SITE_NAME))
  return DocumentFiles(paths[k] for k in split_keys(name)[split])


def _iter_all(name: str) -> Iterator[tuple[str, str]]:
  """(key, text) of every document of corpus `name`, both splits, duplicates included."""
  if name != NAME:
    return _iter_sources(site=name == SITE_NAME)
  return iter(_docstrings())


# Where the docstring corpus, once parsed, is kept for the next process (a file per Python
# installation's standard library); TWELL_JAX_CORPUS_CACHE names another directory, "" none.
CACHE_DIR = "~/.cache/twell_jax/corpora"
_CACHE_FORMAT = 1   # bump when the extraction below changes what a document is


@functools.cache
def _docstrings() -> tuple[tuple[str, str], ...]:
  """The docstring corpus, both splits: parsed once per installation (seconds of CPU, which
  every process without TFDS paid; each split's reader walks every file, since the split is by
  content), then read from a cache file keyed by the standard library's files, sizes and
  modification times."""
  files = _stdlib_files()
  path = _cache_path(files)
  if path is not None:
    try:
      with open(path, encoding="utf-8") as f:
        return tuple((key, text) for key, text in json.load(f))
    except (OSError, ValueError, TypeError):
      pass    # not there yet, or unreadable: parse, and write it again
  out = tuple(_parse_docstrings(files))
  if path is not None:
    _write_cache(path, out)
  return out


def _parse_docstrings(files) -> Iterator[tuple[str, str]]:
  for rel, path in files:
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


def _cache_path(files) -> pathlib.Path | None:
  """The cache file of this standard library's docstring corpus, or None (caching off)."""
  return _keyed_cache_file(NAME, files, f"{_CACHE_FORMAT} {MIN_CHARS} {sys.version}".encode())


def _keyed_cache_file(stem: str, files, how: bytes) -> pathlib.Path | None:
  """`stem`-<digest>.json in the corpus cache (None: caching off), the digest of `how` (what
  makes the cached thing from the files) and of each of `files` (key, size, modification
  time): a file changed, added or removed names another cache file."""
  root = os.environ.get("TWELL_JAX_CORPUS_CACHE", CACHE_DIR)
  if not root:
    return None
  h = hashlib.blake2b(how, digest_size=16)
  for rel, path in files:
    try:
      st = path.stat()
    except OSError:
      continue
    h.update(f"{rel} {st.st_size} {st.st_mtime_ns}\n".encode())
  return pathlib.Path(root).expanduser() / f"{stem}-{h.hexdigest()}.json"


def _write_cache(path: pathlib.Path, documents) -> None:
  """Writes the cache file (`documents`, as JSON) whole or not at all (processes starting
  together may race: the last rename wins, and every writer writes the same bytes)."""
  tmp = None
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(documents, f)
    os.replace(tmp, path)
  except OSError:     # a read-only or full disk: every process parses
    if tmp is not None and os.path.exists(tmp):
      os.unlink(tmp)
