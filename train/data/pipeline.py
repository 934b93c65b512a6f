"""Input pipeline: documents -> tokens -> packed fixed-length rows -> batches.

Sources (random access by document index):
  * local files, `data.files` (`.jsonl`, `.jsonl.gz`, `.parquet`, `.txt`; `train/data/files.py`),
    held out by `data.eval_files` or `data.eval_fraction`;
  * any prepared TFDS dataset, read with `tfds.data_source(name, split=...)`
    (ArrayRecord; no TensorFlow needed), text from feature `text_key`;
  * the offline corpora `text_corpus.CORPORA` (`twell_stdlib_text`, the default; the
    Python sources `twell_python_source` and `twell_python_source_site`; see
    `train/corpus/text_corpus.py`): prepared through TFDS when tensorflow-datasets is installed
    (`use_tfds=True`), otherwise read straight from their generator into a Python list.
    Both give the same documents in the same order, hence identical batches.

Packing (concatenation, as in GPT-style pre-training): per epoch e, the
document order is a seeded permutation (numpy PCG64 seeded with (seed, e); 4
bytes per document; local files permute blocks and the documents inside them,
`files.FileSource.epoch_order`). Process p of P takes every P-th document of it
(every P-th block of files), which is the per-process split. Each document becomes
tokens + [EOS] and is appended to a stream that is cut into rows of seq_len + 1
tokens (inputs are row[:-1], targets row[1:]); leftover tokens carry into the
next batch. Attention is not masked at document boundaries.

Documents are read `CHUNK_DOCS` at a time and tokenized in the packer's thread or,
with `data.workers`, by worker processes (`train/data/workers.py`) a few chunks
ahead; chunks join the stream in order, so the stream and the states are the same
at any worker count. Iterator state is the JSON dict {"epoch", "cursor", "carry"}
(cursor: documents of this process's order consumed, a whole number of chunks):
resuming from it continues the exact token stream. Grain is not used: its data
position would not survive on machines without grain, and this packer is the
same code everywhere. Tokenizers: `train/data/tokenizer.py`.
"""

import collections
import dataclasses
import importlib.util
import queue
import threading
from typing import Iterator, Sequence

import numpy as np

from train import errors
from train.corpus import text_corpus
from train.data import files as files_lib
from train.data import tokenizer as tokenizer_lib
from train.data import workers as workers_lib

CHUNK_DOCS = 16          # documents read (and tokenized) together
_AHEAD_PER_WORKER = 4    # chunks in flight per tokenizing worker


def tfds_available() -> bool:
  return importlib.util.find_spec("tensorflow_datasets") is not None


def uses_tfds(data_cfg) -> bool:
  """Whether `make_source` reads `data_cfg`'s corpus through tensorflow-datasets."""
  if data_cfg.get("files"):
    return False
  if data_cfg.dataset in text_corpus.CORPORA:
    return bool(data_cfg.use_tfds) and tfds_available()
  return True


def import_before_threads(data_cfg) -> None:
  """Imports tensorflow-datasets now where `make_source` will use it. Its import replaces
  `builtins.__import__` for every thread while it runs (etils' `epy.lazy_imports`), so a thread
  that imports meanwhile (jax tracing a step imports modules lazily) gets a module that fails
  when used. Call before starting threads that trace while the data opens."""
  if uses_tfds(data_cfg) and tfds_available():
    import tensorflow_datasets  # pylint: disable=g-import-not-at-top,unused-import


class _TfdsTextSource:
  """Random-access view of a tfds data source returning the text field."""

  def __init__(self, source, text_key: str):
    self._source, self._key = source, text_key

  def __len__(self):
    return len(self._source)

  def get_many(self, indices: Sequence[int]) -> list:
    # Item by item: tfds's batched __getitems__ is not implemented by every
    # source (e.g. tfds.testing.mock_data), and this runs on the prefetch
    # thread, off the training step's critical path.
    return [self._source[int(i)][self._key] for i in indices]


class _ListSource:

  def __init__(self, docs: list):
    self._docs = docs

  def __len__(self):
    return len(self._docs)

  def get_many(self, indices):
    return [self._docs[i] for i in indices]


def document_order(source, seed: int, epoch: int, shard_index: int, shard_count: int,
                   shuffle: bool) -> np.ndarray:
  """This process's document order for `epoch`: the source's own (`epoch_order`, local
  files), else a seeded permutation of every document, every P-th one for process p."""
  if hasattr(source, "epoch_order"):
    return source.epoch_order(seed, epoch, shard_index, shard_count, shuffle)
  n = len(source)
  order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
  return order[shard_index::shard_count]


_FILE_SPLITS: dict = {}


def _file_splits(data_cfg):
  """(train, held-out) `files.FileSource`s of `data.files`, opened once per process (the
  files are indexed when they open)."""
  key = tuple(str(data_cfg.get(k)) for k in (
      "files", "eval_files", "eval_fraction", "text_key", "text_unit"))
  if key not in _FILE_SPLITS:
    _FILE_SPLITS.clear()
    _FILE_SPLITS[key] = files_lib.open_splits(data_cfg)
  return _FILE_SPLITS[key]


def make_source(data_cfg, split: str):
  """Returns an object with __len__ and get_many(indices) -> texts: the `data.files` (train
  or held out, `split` being data.train_split or data.eval_split), else the dataset."""
  if data_cfg.get("files"):
    train, held = _file_splits(data_cfg)
    return held if split == data_cfg.eval_split and split != data_cfg.train_split else train
  name = data_cfg.dataset
  use_tfds = data_cfg.use_tfds and tfds_available()
  if name in text_corpus.CORPORA and not use_tfds:
    if name == text_corpus.NAME:
      return _ListSource([t for _, t in text_corpus.documents(split, name)])
    return text_corpus.document_files(split, name)   # read as trained on
  if not tfds_available():
    raise ImportError(f"data.dataset={name!r} needs tensorflow-datasets; only "
                      f"{', '.join(text_corpus.CORPORA)} work without it.")
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  data_dir = data_cfg.data_dir or None
  if name in text_corpus.CORPORA:
    from train.corpus import tfds_offline  # pylint: disable=g-import-not-at-top
    tfds_offline.prepare(data_dir or tfds.core.constants.DATA_DIR, name)
  source = tfds.data_source(name, split=split, data_dir=data_dir,
                            download=False)
  return _TfdsTextSource(source, data_cfg.text_key)


@dataclasses.dataclass
class PackerState:
  epoch: int = 0
  cursor: int = 0       # next position in this process's document order
  carry: list = dataclasses.field(default_factory=list)  # leftover tokens

  def to_json(self) -> dict:
    return {"epoch": self.epoch, "cursor": self.cursor,
            "carry": [int(t) for t in self.carry]}

  @classmethod
  def from_json(cls, d: dict) -> "PackerState":
    return cls(int(d["epoch"]), int(d["cursor"]), list(d["carry"]))


class PackedBatches:
  """Deterministic stream of int32 batches [rows, seq_len + 1].

  Args:
    source: from `make_source`.
    tokenizer: from `tokenizer.make_tokenizer`.
    seq_len: T; rows hold T + 1 tokens.
    rows: rows per batch on this process.
    seed: shuffle seed; `shuffle=False` keeps the source order (eval).
    shard_index, shard_count: this process's share of the documents.
    repeat: False stops after one epoch (eval).
    workers: tokenizing worker processes (0: tokenize in the calling thread); the batches
      and states are the same at any count. `close()` stops them.
  """

  def __init__(self, source, tokenizer: tokenizer_lib.Tokenizer, *, seq_len: int, rows: int,
               seed: int, shard_index: int = 0, shard_count: int = 1,
               shuffle: bool = True, repeat: bool = True, workers: int = 0):
    if len(source) < shard_count:
      raise ValueError(f"source has {len(source)} documents, fewer than "
                       f"{shard_count} processes")
    self._source, self._tok = source, tokenizer
    self._row_len, self._rows = seq_len + 1, rows
    self._seed, self._shuffle, self._repeat = seed, shuffle, repeat
    self._shard = (shard_index, shard_count)
    self.state = PackerState()
    self._order_epoch, self._order = None, None
    self._pool = workers_lib.EncoderPool(tokenizer, workers) if workers > 0 else None
    # Chunks read and sent to the workers, not yet in the stream: (future, epoch, cursor
    # after the chunk); `_read` is where reading stands (ahead of `state`).
    self._pending: collections.deque = collections.deque()
    self._read = (0, 0)

  def _doc_order(self, epoch: int) -> np.ndarray:
    if self._order_epoch != epoch:
      self._order = document_order(self._source, self._seed, epoch, *self._shard,
                                   shuffle=self._shuffle)
      if not len(self._order):
        raise ValueError(f"process {self._shard[0]} of {self._shard[1]} has no documents")
      self._order_epoch = epoch
    return self._order

  def _read_chunk(self, epoch: int, cursor: int):
    """(documents, epoch, cursor) of the chunk at (epoch, cursor); no documents at the end
    of a non-repeating epoch."""
    order = self._doc_order(epoch)
    if cursor >= len(order):
      if not self._repeat:
        return [], epoch, cursor
      epoch, cursor = epoch + 1, 0
      order = self._doc_order(epoch)
    idx = order[cursor:cursor + CHUNK_DOCS]
    return self._source.get_many([int(i) for i in idx]), epoch, cursor + len(idx)

  def _next_chunk(self) -> list[np.ndarray]:
    """The next chunk's token arrays ([] at the end); moves `state` past it."""
    if self._pool is None:
      docs, self.state.epoch, self.state.cursor = self._read_chunk(self.state.epoch,
                                                                   self.state.cursor)
      return tokenizer_lib.encode_many(self._tok, docs)
    if not self._pending:
      self._read = (self.state.epoch, self.state.cursor)
    while len(self._pending) < _AHEAD_PER_WORKER * len(self._pool):
      docs, epoch, cursor = self._read_chunk(*self._read)
      if not docs:
        break
      self._pending.append((self._pool.submit(docs), epoch, cursor))
      self._read = (epoch, cursor)
    if not self._pending:
      return []
    future, self.state.epoch, self.state.cursor = self._pending.popleft()
    return future.result()

  def next_batch(self) -> np.ndarray | None:
    """[rows, seq_len + 1] int32, or None when a non-repeating epoch is done."""
    need = self._rows * self._row_len
    pieces = [np.asarray(self.state.carry, np.int32)]
    have = len(self.state.carry)
    eos = np.array([self._tok.eos_id], np.int32)
    while have < need:
      chunk = self._next_chunk()
      if not chunk:
        return None
      for ids in chunk:
        pieces += [ids, eos]
        have += len(ids) + 1
    stream = np.concatenate(pieces)
    self.state.carry = stream[need:].tolist()
    return stream[:need].reshape(self._rows, self._row_len)

  def get_state(self) -> dict:
    return self.state.to_json()

  def passes(self, state: dict) -> float:
    """Passes over this process's documents at `state` (a `get_state` dict): whole epochs
    plus the share of this epoch's documents read."""
    return state["epoch"] + state["cursor"] / len(self._doc_order(state["epoch"]))

  def set_state(self, d: dict) -> None:
    self.state = PackerState.from_json(d)
    for future, _, _ in self._pending:
      future.cancel()
    self._pending.clear()

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None


class Prefetcher:
  """Runs `packer.next_batch` on a thread; yields (batch, state after it).

  The state is captured right after each batch is produced, so a checkpoint
  written after consuming a batch records exactly where the data stands, no
  matter how many batches the thread has prepared ahead.
  """

  def __init__(self, packer: PackedBatches, depth: int = 2):
    self._packer = packer
    self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    try:
      while not self._stop.is_set():
        batch = self._packer.next_batch()
        item = (batch, self._packer.get_state())
        while not self._stop.is_set():
          try:
            self._q.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
        if batch is None:
          return
    except Exception as e:  # pylint: disable=broad-except
      self._q.put(e)  # Re-raised in the consumer thread.

  def __iter__(self) -> Iterator[tuple[np.ndarray, dict]]:
    return self

  def __next__(self):
    item = self._q.get()
    if isinstance(item, Exception):
      raise item
    if item[0] is None:
      raise StopIteration
    return item

  def close(self):
    self._stop.set()
    self._thread.join(timeout=5)
    self._packer.close()


def eval_batches(data_cfg, tokenizer, *, seq_len: int, rows: int,
                 num_batches: int, shard_index: int = 0,
                 shard_count: int = 1) -> list[np.ndarray]:
  """The first `num_batches` packed batches of the eval split, unshuffled."""
  source = make_source(data_cfg, data_cfg.eval_split)
  packer = PackedBatches(source, tokenizer, seq_len=seq_len, rows=rows,
                         seed=0, shard_index=shard_index,
                         shard_count=shard_count, shuffle=False, repeat=False)
  out = []
  for _ in range(num_batches):
    batch = packer.next_batch()
    if batch is None:
      break
    out.append(batch)
  if not out:
    more = ("hold out more documents (config.data.eval_fraction or config.data.eval_files)"
            if data_cfg.get("files") else "use a larger split")
    raise errors.DataError(f"eval split {data_cfg.eval_split!r} is too small for one"
                           f" batch of {rows} x {seq_len + 1} tokens: {more}")
  return out
