"""Input pipeline: documents -> tokens -> packed fixed-length rows -> batches.

Sources (random access by document index):
  * any prepared TFDS dataset, read with `tfds.data_source(name, split=...)`
    (ArrayRecord; no TensorFlow needed), text from feature `text_key`;
  * the offline corpora `text_corpus.CORPORA` (`twell_stdlib_text`, the default; the
    Python sources `twell_python_source` and `twell_python_source_site`; see
    `train/corpus/text_corpus.py`): prepared through TFDS when tensorflow-datasets is installed
    (`use_tfds=True`), otherwise read straight from their generator into a Python list.
    Both give the same documents in the same order, hence identical batches.

Packing (concatenation, as in GPT-style pre-training): per epoch e, the
document order is a seeded permutation (numpy PCG64 seeded with (seed, e); 4
bytes per document). Process p of P takes every P-th document of it, which is
the per-process split. Each document becomes tokens + [EOS] and is appended to
a stream that is cut into rows of seq_len + 1 tokens (inputs are row[:-1],
targets row[1:]); leftover tokens carry into the next batch. Attention is not
masked at document boundaries.

Iterator state is the JSON dict {"epoch", "cursor", "carry"}: resuming from it
continues the exact token stream. Grain is not used: its data position would
not survive on machines without grain, and this packer is the same code
everywhere. Tokenization is byte-level (UTF-8 bytes + 3 special ids) by
default; a SentencePiece model file is optional (needs `sentencepiece`).
"""

import dataclasses
import importlib.util
import queue
import threading
from typing import Iterator, Protocol, Sequence

import numpy as np

from train.corpus import text_corpus

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int

  def encode(self, text: str | bytes) -> np.ndarray: ...
  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes shifted by 3 (0 pad, 1 bos, 2 eos): vocab 259, no files."""
  vocab_size = 259
  eos_id = EOS_ID

  def encode(self, text):
    if isinstance(text, str):
      text = text.encode("utf-8")
    return np.frombuffer(text, np.uint8).astype(np.int32) + 3

  def decode(self, ids):
    b = bytes(int(i) - 3 for i in ids if int(i) >= 3)
    return b.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece model file (optional dependency `sentencepiece`)."""

  def __init__(self, model_path: str):
    try:
      import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("tokenizer='sentencepiece' needs `pip install "
                        "sentencepiece`; the default is 'byte'.") from e
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else 0

  def encode(self, text):
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids):
    return self._sp.decode([int(i) for i in ids])


def make_tokenizer(data_cfg) -> Tokenizer:
  if data_cfg.tokenizer == "byte":
    return ByteTokenizer()
  if data_cfg.tokenizer == "sentencepiece":
    return SentencePieceTokenizer(data_cfg.spm_model)
  raise ValueError(f"data.tokenizer={data_cfg.tokenizer!r}: expected 'byte' "
                   "or 'sentencepiece'")


def tfds_available() -> bool:
  return importlib.util.find_spec("tensorflow_datasets") is not None


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


def make_source(data_cfg, split: str):
  """Returns an object with __len__ and get_many(indices) -> texts."""
  name = data_cfg.dataset
  use_tfds = data_cfg.use_tfds and tfds_available()
  if name in text_corpus.CORPORA and not use_tfds:
    return _ListSource([t for _, t in text_corpus.iter_documents(split, name)])
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
    tokenizer: from `make_tokenizer`.
    seq_len: T; rows hold T + 1 tokens.
    rows: rows per batch on this process.
    seed: shuffle seed; `shuffle=False` keeps the source order (eval).
    shard_index, shard_count: this process's share of the documents.
    repeat: False stops after one epoch (eval).
  """

  def __init__(self, source, tokenizer: Tokenizer, *, seq_len: int, rows: int,
               seed: int, shard_index: int = 0, shard_count: int = 1,
               shuffle: bool = True, repeat: bool = True):
    if len(source) < shard_count:
      raise ValueError(f"source has {len(source)} documents, fewer than "
                       f"{shard_count} processes")
    self._source, self._tok = source, tokenizer
    self._row_len, self._rows = seq_len + 1, rows
    self._seed, self._shuffle, self._repeat = seed, shuffle, repeat
    self._shard = (shard_index, shard_count)
    self.state = PackerState()
    self._order_epoch, self._order = None, None

  def _doc_order(self, epoch: int) -> np.ndarray:
    if self._order_epoch != epoch:
      n = len(self._source)
      if self._shuffle:
        order = np.random.default_rng([self._seed, epoch]).permutation(n)
      else:
        order = np.arange(n)
      self._order = order[self._shard[0]::self._shard[1]]
      self._order_epoch = epoch
    return self._order

  def _next_docs(self, k: int = 16) -> list:
    """Up to k next documents; advances epoch/cursor. [] at the end (no repeat)."""
    order = self._doc_order(self.state.epoch)
    if self.state.cursor >= len(order):
      if not self._repeat:
        return []
      self.state.epoch += 1
      self.state.cursor = 0
      order = self._doc_order(self.state.epoch)
    idx = order[self.state.cursor:self.state.cursor + k]
    self.state.cursor += len(idx)
    return self._source.get_many([int(i) for i in idx])

  def next_batch(self) -> np.ndarray | None:
    """[rows, seq_len + 1] int32, or None when a non-repeating epoch is done."""
    need = self._rows * self._row_len
    pieces = [np.asarray(self.state.carry, np.int32)]
    have = len(self.state.carry)
    eos = np.array([self._tok.eos_id], np.int32)
    while have < need:
      docs = self._next_docs()
      if not docs:
        return None
      for doc in docs:
        ids = self._tok.encode(doc)
        pieces += [ids, eos]
        have += len(ids) + 1
    stream = np.concatenate(pieces)
    self.state.carry = stream[need:].tolist()
    return stream[:need].reshape(self._rows, self._row_len)

  def get_state(self) -> dict:
    return self.state.to_json()

  def set_state(self, d: dict) -> None:
    self.state = PackerState.from_json(d)


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
    raise ValueError(f"eval split {data_cfg.eval_split!r} is too small for one"
                     f" batch of {rows} x {seq_len + 1} tokens")
  return out
