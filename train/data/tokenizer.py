"""Tokenizers: text -> int32 ids and back.

* `byte` (the default): UTF-8 bytes shifted by 3 (0 pad, 1 bos, 2 eos); vocabulary 259, no file.
* `sentencepiece`: a SentencePiece `.model` file (`data.spm_model`; `sentencepiece`).
* `hf`: a Hugging Face `tokenizer.json` (`data.tokenizer_file`; the `tokenizers` library), as
  Llama 3, Qwen2.5, SmolLM2 and GPT-2 ship it. The end-of-document id appended after each
  document is `data.eos_token`, else the `eos_token` of a `tokenizer_config.json` beside the
  file, else the first of `KNOWN_EOS_TOKENS` the vocabulary holds.

Every tokenizer pickles as its file's path (and settings), so the tokenizing worker processes
(`train.data.workers`) rebuild it from the same file. `encode_many` tokenizes a list of texts
in one call (the libraries' batch encoders where they have one).
"""

import json
import os
from typing import Protocol, Sequence

import numpy as np

from train import errors

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TOKENIZERS = ("byte", "sentencepiece", "hf")
# End-of-text tokens of common tokenizer.json files (Llama 3, Qwen2.5, GPT-2 / SmolLM2, Llama 2).
KNOWN_EOS_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>", "<eos>")


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


# Threads a SentencePiece batch encode uses in the process that loaded the model (the
# held-out batches at a run's start, packing without workers): its C++ encoder splits a batch
# of documents over them (1M tokens: 0.84 s on one thread, 0.45 s on two, 2-core CPU). A copy
# sent to a tokenizing worker process uses one: the workers are the parallelism there.
SPM_THREADS = min(8, os.cpu_count() or 1)


class SentencePieceTokenizer:
  """A SentencePiece model file (optional dependency `sentencepiece`); `num_threads` per
  batch encode (default `SPM_THREADS`; one in a copy sent to another process)."""

  def __init__(self, model_path: str, num_threads: int | None = None):
    try:
      import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("tokenizer='sentencepiece' needs `pip install "
                        "sentencepiece`; the default is 'byte'.") from e
    self.path = model_path
    self.num_threads = SPM_THREADS if num_threads is None else num_threads
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else 0

  def __reduce__(self):
    return SentencePieceTokenizer, (self.path, 1)

  def encode(self, text):
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    return np.asarray(self._sp.encode(text), np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, np.int32)
            for ids in self._sp.encode(texts, num_threads=self.num_threads)]

  def decode(self, ids):
    return self._sp.decode([int(i) for i in ids])


def _configured_eos(path: str) -> str | None:
  """The eos_token of the tokenizer_config.json beside `path`, if there is one."""
  cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
  if not os.path.isfile(cfg_path):
    return None
  with open(cfg_path) as f:
    eos = json.load(f).get("eos_token")
  if isinstance(eos, dict):  # {"content": "</s>", ...} in older files
    eos = eos.get("content")
  return eos if isinstance(eos, str) else None


class HFTokenizer:
  """A Hugging Face `tokenizer.json` (the `tokenizers` library).

  Documents are encoded without the special tokens a post-processor would add (BOS): the
  packer separates documents with `eos_id`, as for the other tokenizers.
  """

  def __init__(self, path: str, eos_token: str | None = None):
    try:
      from tokenizers import Tokenizer as _HF  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("tokenizer='hf' needs `pip install tokenizers`") from e
    self.path, self._eos_token = path, eos_token
    try:
      self._tok = _HF.from_file(path)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"{path}: not a tokenizer.json the tokenizers library reads "
                       f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1 if vocab else 0
    eos = eos_token or _configured_eos(path)
    if eos is None:
      eos = next((t for t in KNOWN_EOS_TOKENS if t in vocab), None)
    if eos is None or eos not in vocab:
      raise ValueError(
          f"{path}: no end-of-document token "
          + (f"({eos!r} is not in its vocabulary); " if eos else "found; ")
          + "name one with --config.data.eos_token")
    self.eos_token, self.eos_id = eos, int(vocab[eos])

  def __reduce__(self):
    return HFTokenizer, (self.path, self._eos_token)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def encode(self, text):
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # tokenizers < 0.21
    out = fast(texts, add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in out]

  def decode(self, ids):
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def encode_many(tokenizer: Tokenizer, texts: list) -> list[np.ndarray]:
  """Each text's ids, through the tokenizer's batch encoder where it has one."""
  batch = getattr(tokenizer, "encode_batch", None)
  if batch is not None and texts and all(isinstance(t, str) for t in texts):
    return batch(texts)
  return [tokenizer.encode(t) for t in texts]


_FILE_FIELDS = {"sentencepiece": "spm_model", "hf": "tokenizer_file"}


def _load(data_cfg) -> Tokenizer:
  kind = data_cfg.tokenizer
  if kind == "byte":
    return ByteTokenizer()
  if kind == "sentencepiece":
    return SentencePieceTokenizer(data_cfg.spm_model)
  if kind == "hf":
    return HFTokenizer(data_cfg.get("tokenizer_file"), data_cfg.get("eos_token") or None)
  raise errors.ConfigError(f"config.data.tokenizer={kind!r}: must be one of {TOKENIZERS}")


def make_tokenizer(data_cfg) -> Tokenizer:
  """The config's tokenizer; one that cannot be loaded is a ConfigError naming its field."""
  try:
    return _load(data_cfg)
  except errors.ConfigError:
    raise
  except (OSError, RuntimeError, ValueError) as e:  # unreadable; (hf) no end-of-document token
    field = _FILE_FIELDS.get(data_cfg.tokenizer, "tokenizer")
    raise errors.ConfigError(f"config.data.{field}: the {data_cfg.tokenizer} tokenizer cannot "
                             f"be loaded: {e}") from None  # both libraries name the file
