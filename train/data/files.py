"""Local text files as a document source: `.jsonl`, `.jsonl.gz`, `.parquet`, `.txt`.

`FileSource(patterns, text_key=..., text_unit=...)` expands comma-separated globs (sorted, so
the same files give the same order on every machine), counts each file's documents once when
it opens, and reads documents by global index (`get_many`). Documents are numbered file by
file in sorted path order.

* `.parquet`: one document per row, the string column `text_key`; read with pyarrow (the
  reference implementation of the format, columnar: only the text column is decoded). A row
  group is one block.
* `.jsonl`: one JSON object per line, text in field `text_key`; blank lines skipped. The line
  starts are indexed with numpy when the file first opens (kept in `data.index_cache_dir`
  under the file's path, size and modification time); a block is `JSONL_BLOCK` lines.
* `.jsonl.gz`: as `.jsonl`, gzip-compressed; the whole file is one block (gzip cannot seek).
* `.txt`: UTF-8 text; `text_unit` "paragraph" (blank-line separated), "line" or "file". The
  whole file is one block.

Shuffling is by block (`epoch_order`): each epoch permutes the blocks and the documents inside
each block, so reading stays sequential within a block (a parquet row group is decoded once,
not once per document) while every document moves. Process p of P reads blocks p, p + P, ...
(each process decodes only its own blocks); with fewer blocks than processes, documents are
dealt instead.

Problems are `errors.DataError` naming the file: a pattern matching nothing, an unknown
extension, a file without documents, a missing or non-string text field, invalid UTF-8. The
cheap checks (patterns, extensions, the parquet schema, the first record of each JSON file,
UTF-8 and the document count of text files) run when the source opens, before anything
trains; a bad record further inside a JSON or parquet file stops the run when it is reached.
"""

import bisect
import collections
import glob
import gzip
import hashlib
import json
import os
import time
from typing import Sequence

from absl import logging
import numpy as np

from train import errors

TEXT_UNITS = ("paragraph", "line", "file")
EXTENSIONS = (".jsonl", ".jsonl.gz", ".parquet", ".txt")
JSONL_BLOCK = 4096          # lines per block of a .jsonl file
_SCAN_BYTES = 64 << 20      # bytes read at a time while indexing a .jsonl file
_CACHED_BLOCKS = 2


def expand(patterns: str | Sequence[str], field: str = "data.files") -> list[str]:
  """The sorted, de-duplicated files of comma-separated glob patterns."""
  if isinstance(patterns, str):
    patterns = [p.strip() for p in patterns.split(",")]
  paths = set()
  for pattern in (p for p in patterns if p):
    found = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
             if os.path.isfile(p)]
    if not found:
      raise errors.DataError(f"config.{field}: {pattern!r} matches no file")
    paths.update(os.path.abspath(p) for p in found)
  if not paths:
    raise errors.DataError(f"config.{field} is empty: give glob patterns of "
                           f"{', '.join(EXTENSIONS)} files")
  for p in paths:
    if not p.endswith(EXTENSIONS):
      raise errors.DataError(f"{p}: not one of the formats read ({', '.join(EXTENSIONS)})")
  return sorted(paths)


def _decode(raw: bytes, path: str, first_line: int = 1) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = first_line + raw.count(b"\n", 0, e.start)
    raise errors.DataError(f"{path}:{line}: invalid UTF-8 (byte {e.start})") from None


def _record_text(line: bytes | str, path: str, line_no, key: str) -> str:
  """The text field of one JSON line; `line_no` (an int, or a function giving it) names the
  line in an error."""
  where = lambda: f"{path}:{line_no() if callable(line_no) else line_no}"  # pylint: disable=unnecessary-lambda-assignment
  try:
    record = json.loads(line)
  except ValueError as e:
    raise errors.DataError(f"{where()}: not a JSON object ({e})") from None
  if not isinstance(record, dict) or key not in record:
    raise errors.DataError(f"{where()}: no field {key!r} (config.data.text_key)")
  text = record[key]
  if not isinstance(text, str):
    raise errors.DataError(f"{where()}: field {key!r} is {type(text).__name__}, not text")
  return text


class _Jsonl:
  """A .jsonl file: line starts indexed once, read a block of lines at a time."""

  def __init__(self, path: str, key: str, index_dir: str | None = None):
    self.path, self._key = path, key
    self.starts, self.ends = _cached(path, index_dir, self._index)
    self.count = len(self.starts)
    self.blocks = [min(JSONL_BLOCK, self.count - b) for b in range(0, self.count, JSONL_BLOCK)]
    if self.count:
      self.read_block(0, limit=1)  # the first record's text field, before anything trains

  def _index(self) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) byte offsets of the non-blank lines, UTF-8 checked on the way."""
    path = self.path
    starts, ends, base, line = [], [], 0, 1
    with open(path, "rb") as f:
      carry = b""
      while True:
        chunk = f.read(_SCAN_BYTES)
        buf = carry + chunk
        if not buf:
          break
        cut = buf.rfind(b"\n") + 1 if chunk else len(buf)
        body, carry = buf[:cut], buf[cut:]
        _decode(body, path, line)
        arr = np.frombuffer(body, np.uint8)
        nl = np.flatnonzero(arr == 10)
        line += len(nl)
        s, e = np.concatenate([[0], nl + 1]), np.append(nl, len(body))
        keep = ~_blank_lines(arr, s, e)
        starts.append(base + s[keep])
        ends.append(base + e[keep])
        base += len(body)
    empty = np.zeros(0, np.int64)
    return (np.concatenate(starts) if starts else empty,
            np.concatenate(ends) if ends else empty)

  def _line_of(self, offset: int) -> int:
    with open(self.path, "rb") as f:
      return 1 + f.read(offset).count(b"\n")

  def read_block(self, b: int, limit: int | None = None) -> list[str]:
    lo = b * JSONL_BLOCK
    hi = min(self.count, lo + (limit or JSONL_BLOCK))
    base = int(self.starts[lo])
    with open(self.path, "rb") as f:
      f.seek(base)
      raw = f.read(int(self.ends[hi - 1]) - base)
    return [_record_text(raw[s - base:e - base], self.path, lambda s=s: self._line_of(s),
                         self._key)
            for s, e in zip(self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist())]


def _cached(path: str, index_dir: str | None, build):
  """`build()`'s line index of `path`, kept in `index_dir` under the file's path, size and
  modification time (each process of a run, and each resume, reads it instead of scanning
  the file again); None: no cache."""
  if not index_dir:
    return build()
  st = os.stat(path)
  key = hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
  where = os.path.join(os.path.expanduser(index_dir), key + ".npz")
  try:
    with np.load(where) as z:
      return z["starts"], z["ends"]
  except (OSError, KeyError, ValueError):
    pass
  starts, ends = build()
  try:
    os.makedirs(os.path.dirname(where), exist_ok=True)
    tmp = f"{where}.{os.getpid()}.tmp.npz"
    np.savez(tmp, starts=starts, ends=ends)
    os.replace(tmp, where)
  except OSError:  # a read-only cache: the next start indexes again
    pass
  return starts, ends


def _blank_lines(arr: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
  """Lines holding only whitespace (' ', '\\t', '\\r'), vectorised."""
  space = (arr == 32) | (arr == 9) | (arr == 13)
  nonspace = np.concatenate([[0], np.cumsum(~space)])
  return (nonspace[ends] - nonspace[starts]) == 0


class _WholeFile:
  """A .jsonl.gz or .txt file: read whole, one block."""

  def __init__(self, path: str, key: str, text_unit: str):
    self.path, self._key, self._unit = path, key, text_unit
    docs = self._documents()
    self.count = len(docs)
    self.blocks = [self.count] if self.count else []
    if path.endswith(".gz") and docs:
      _record_text(docs[0][1], path, docs[0][0], key)

  def _documents(self) -> list:
    if self.path.endswith(".jsonl.gz"):
      try:
        with gzip.open(self.path, "rb") as f:
          raw = f.read()
      except (OSError, EOFError) as e:
        raise errors.DataError(f"{self.path}: not a gzip file ({e})") from None
      lines = _decode(raw, self.path).split("\n")
      return [(i, ln) for i, ln in enumerate(lines, 1) if ln.strip()]
    with open(self.path, "rb") as f:
      text = _decode(f.read(), self.path)
    if self._unit == "file":
      parts = [text]
    elif self._unit == "line":
      parts = text.split("\n")
    else:
      parts = [p.strip("\n") for p in text.replace("\r\n", "\n").split("\n\n")]
    return [p for p in parts if p.strip()]

  def read_block(self, b: int) -> list[str]:
    del b
    docs = self._documents()
    if self.path.endswith(".jsonl.gz"):
      return [_record_text(ln, self.path, i, self._key) for i, ln in docs]
    return docs


class _Parquet:
  """A .parquet file: one document per row of column `key`, a row group per block."""

  def __init__(self, path: str, key: str):
    try:
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise errors.DataError(f"{path}: reading parquet needs `pip install pyarrow`") from e
    self.path, self._key = path, key
    try:
      self._file = pq.ParquetFile(path)
    except Exception as e:  # pylint: disable=broad-except
      raise errors.DataError(f"{path}: not a parquet file ({e})") from None
    schema = self._file.schema_arrow
    if key not in schema.names:
      raise errors.DataError(f"{path}: no column {key!r} (config.data.text_key); columns: "
                             f"{', '.join(schema.names)}")
    kind = str(schema.field(key).type)
    if kind not in ("string", "large_string", "string_view"):
      raise errors.DataError(f"{path}: column {key!r} is {kind}, not text")
    meta = self._file.metadata
    self.blocks = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    self.blocks = [n for n in self.blocks if n]
    self._groups = [g for g in range(meta.num_row_groups) if meta.row_group(g).num_rows]
    self.count = sum(self.blocks)

  def read_block(self, b: int) -> list[str]:
    try:
      texts = self._file.read_row_group(self._groups[b], columns=[self._key]) \
          .column(0).to_pylist()
    except UnicodeDecodeError as e:
      raise errors.DataError(f"{self.path}: row group {self._groups[b]}: invalid UTF-8 "
                             f"({e})") from None
    for i, t in enumerate(texts):
      if t is None:
        row = sum(self.blocks[:b]) + i
        raise errors.DataError(f"{self.path}: row {row}: {self._key!r} is null")
    return texts


def _open(path: str, key: str, text_unit: str, index_dir: str | None):
  if path.endswith(".parquet"):
    f = _Parquet(path, key)
  elif path.endswith(".jsonl"):
    f = _Jsonl(path, key, index_dir)
  else:
    f = _WholeFile(path, key, text_unit)
  if not f.count:
    raise errors.DataError(f"{path}: no documents (an empty file?)")
  return f


class FileSource:
  """Documents [lo, hi) of the files `patterns` name, by global index (module docstring)."""

  def __init__(self, patterns, *, text_key: str = "text", text_unit: str = "paragraph",
               field: str = "data.files", index_dir: str | None = None,
               files: list | None = None, lo: int = 0, hi: int | None = None):
    if text_unit not in TEXT_UNITS:
      raise errors.DataError(f"config.data.text_unit={text_unit!r}: one of {TEXT_UNITS}")
    self.paths = expand(patterns, field) if files is None else [f.path for f in files]
    t0 = time.perf_counter()
    self._files = files or [_open(p, text_key, text_unit, index_dir) for p in self.paths]
    # Blocks as (file, block in file, first global document, documents).
    blocks, first = [], 0
    for i, f in enumerate(self._files):
      for b, n in enumerate(f.blocks):
        blocks.append((i, b, first, n))
        first += n
    self.total = first
    self.lo, self.hi = lo, first if hi is None else hi
    # Clipped to [lo, hi): this view's blocks.
    self._blocks = [(i, b, max(s, self.lo), min(s + n, self.hi)) for i, b, s, n in blocks
                    if s < self.hi and s + n > self.lo]
    self._starts = [s for _, _, s, _ in blocks]
    self._all_blocks = blocks
    self._cache: collections.OrderedDict = collections.OrderedDict()
    if files is None:
      logging.info("config.%s: %d files, %d documents in %d blocks (opened in %.1f s)", field,
                   len(self.paths), self.total, len(blocks), time.perf_counter() - t0)

  def split(self, fraction: float) -> tuple["FileSource", "FileSource"]:
    """(the first 1 - fraction of the documents, the rest): a train and a held-out view."""
    n_eval = max(1, int(round(self.total * fraction)))
    if n_eval >= self.total:
      raise errors.DataError(
          f"config.data.files: {self.total} documents, too few to hold out "
          f"config.data.eval_fraction={fraction} of them; give config.data.eval_files")
    cut = self.total - n_eval
    return (FileSource(None, files=self._files, lo=0, hi=cut),
            FileSource(None, files=self._files, lo=cut, hi=self.total))

  def __len__(self):
    return self.hi - self.lo

  def _block_docs(self, k: int) -> list[str]:
    if k not in self._cache:
      i, b, _, _ = self._all_blocks[k]
      self._cache[k] = self._files[i].read_block(b)
      while len(self._cache) > _CACHED_BLOCKS:
        self._cache.popitem(last=False)
    return self._cache[k]

  def get_many(self, indices: Sequence[int]) -> list[str]:
    """Documents by index into this view (0 = document `lo`)."""
    out = []
    for j in indices:
      g = self.lo + int(j)
      k = bisect.bisect_right(self._starts, g) - 1
      out.append(self._block_docs(k)[g - self._starts[k]])
    return out

  def epoch_order(self, seed: int, epoch: int, shard_index: int, shard_count: int,
                  shuffle: bool) -> np.ndarray:
    """This process's document order for `epoch` (indices into this view)."""
    blocks = [np.arange(lo, hi) - self.lo for _, _, lo, hi in self._blocks]
    if shuffle:
      rng = np.random.default_rng([seed, epoch])
      perm = rng.permutation(len(blocks))
      blocks = [rng.permutation(blocks[k]) for k in perm]
    if len(blocks) >= shard_count:
      mine = blocks[shard_index::shard_count]
      return np.concatenate(mine) if mine else np.zeros(0, np.int64)
    return np.concatenate(blocks)[shard_index::shard_count]


def open_splits(data_cfg) -> tuple[FileSource, FileSource]:
  """(train, held-out) sources of `data.files` (module docstring; config/default.py)."""
  key, unit = data_cfg.text_key, data_cfg.get("text_unit", "paragraph")
  index_dir = data_cfg.get("index_cache_dir")
  train = FileSource(data_cfg.files, text_key=key, text_unit=unit, index_dir=index_dir)
  if data_cfg.get("eval_files"):
    held = FileSource(data_cfg.eval_files, text_key=key, text_unit=unit,
                      field="data.eval_files", index_dir=index_dir)
    both = sorted(set(train.paths) & set(held.paths))
    if both:
      raise errors.DataError(f"config.data.eval_files and config.data.files both name "
                             f"{both[0]}: the held-out documents would be trained on")
    return train, held
  return train.split(data_cfg.eval_fraction)
