r"""Trains a SentencePiece tokenizer on an offline corpus: one command, no download.

    python -m train.corpus.build_tokenizer --dataset=twell_python_source_site \
        --vocab_size=32000 --out=/data/tok/py32k   # writes py32k.model and py32k.json

then train with `--config.data.tokenizer=sentencepiece
--config.data.spm_model=/data/tok/py32k.model`
(the model's `vocab_size` must be at least the tokenizer's; the paper configs have 32000).
`train.export_hf` writes the model file into the Hugging Face directory and
`train.import_hf` reads it back.

The tokenizer is for source code as much as prose: BPE with byte fallback (every byte
string encodes), no normalization and no whitespace folding (indentation and newlines
survive, `decode(encode(text)) == text`), digits split. It trains on the corpus's "train"
split only, cut at line ends into pieces of at most `--piece_bytes`, at most `--max_bytes`
of it (documents taken in a fixed, hashed order, so the same corpus gives the same model).
Special ids: 0 pad, 1 eos, 2 unk, no bos (the trainer's packer appends eos to each
document). `<out>.json` records the corpus (`text_corpus.fingerprint`), the options and
the time the training took.

`build_bpe_json` trains a Hugging Face `tokenizer.json` instead (byte-level BPE, GPT-2 /
Llama 3 style, through the `tokenizers` library) on given texts, for `data.tokenizer=hf`.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from typing import Iterator

from absl import app
from absl import flags

from train.corpus import text_corpus


def _pieces(dataset: str, max_bytes: int, piece_bytes: int) -> Iterator[str]:
  """The train split in pieces cut at line ends, documents in a hashed order, until
  `max_bytes`."""
  docs = sorted(text_corpus.iter_documents("train", dataset),
                key=lambda kt: zlib.crc32(kt[0].encode()))
  total = 0
  for _, text in docs:
    piece = []
    size = 0
    for line in text.splitlines(keepends=True):
      n = len(line.encode())
      if n > piece_bytes:  # a very long line (data, minified code): skipped
        continue
      if size + n > piece_bytes and piece:
        yield "".join(piece)
        total += size
        piece, size = [], 0
        if total >= max_bytes:
          return
      piece.append(line)
      size += n
    if piece:
      yield "".join(piece)
      total += size
      if total >= max_bytes:
        return


def build(out: str, *, dataset: str = text_corpus.SITE_NAME, vocab_size: int = 32000,
          max_bytes: int = 64 << 20, piece_bytes: int = 2048, threads: int | None = None
          ) -> dict:
  """Trains the tokenizer into `out`.model and records it in `out`.json; returns the
  record. An existing `out`.model of the same corpus and options is kept."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  out = os.path.expanduser(out)
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  options = {"dataset": dataset, "vocab_size": vocab_size, "max_bytes": max_bytes,
             "piece_bytes": piece_bytes}
  corpus = text_corpus.fingerprint(dataset, "train")
  record_path = out + ".json"
  if os.path.exists(out + ".model") and os.path.exists(record_path):
    with open(record_path) as f:
      old = json.load(f)
    if old.get("options") == options and old.get("corpus") == corpus:
      return old
  t0 = time.time()
  with open(out + ".model.tmp", "wb") as f:
    spm.SentencePieceTrainer.train(
        sentence_iterator=_pieces(dataset, max_bytes, piece_bytes), model_writer=f,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True,
        max_sentence_length=4 * piece_bytes, character_coverage=0.9999,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, train_extremely_large_corpus=False,
        num_threads=threads or os.cpu_count() or 1, minloglevel=2)
  os.replace(out + ".model.tmp", out + ".model")
  record = {"model": out + ".model", "options": options, "corpus": corpus,
            "seconds": round(time.time() - t0, 1)}
  with open(record_path, "w") as f:
    json.dump(record, f, indent=1)
  return record


def build_bpe_json(out_dir: str, texts, vocab_size: int,
                   special_tokens=("<pad>", "<s>", "<|endoftext|>"),
                   eos_token: str = "<|endoftext|>") -> str:
  """A byte-level BPE tokenizer.json trained on `texts`, written into `out_dir` with a
  tokenizer_config.json naming `eos_token`, as Hugging Face model directories ship them;
  returns the tokenizer.json's path. The special tokens take the first ids."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import pre_tokenizers  # pylint: disable=import-outside-toplevel
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  os.makedirs(out_dir, exist_ok=True)
  out = os.path.join(out_dir, "tokenizer.json")
  tok.save(out)
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token}, f)
  return out


def main(argv):
  del argv
  fl = flags.FLAGS
  record = build(fl.out, dataset=fl.dataset, vocab_size=fl.vocab_size,
                 max_bytes=fl.max_bytes, piece_bytes=fl.piece_bytes)
  c = record["corpus"]
  print(f"{record['model']}: {fl.vocab_size} pieces from {c['name']} "
        f"({c['documents']} documents, {c['bytes'] / 1e6:.1f} MB, sha256 {c['sha256'][:12]}) "
        f"in {record['seconds']} s")


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "output path without extension (.model and .json)")
  flags.DEFINE_enum("dataset", text_corpus.SITE_NAME, list(text_corpus.CORPORA),
                    "offline corpus to train on (its train split)")
  flags.DEFINE_integer("vocab_size", 32000, "pieces, special and byte pieces included")
  flags.DEFINE_integer("max_bytes", 64 << 20, "at most this much text is trained on")
  flags.DEFINE_integer("piece_bytes", 2048, "text is cut at line ends into pieces this long")
  flags.mark_flag_as_required("out")
  app.run(main)
