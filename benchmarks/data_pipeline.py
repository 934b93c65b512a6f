r"""Input pipeline throughput: packed tokens/s by tokenizing worker count, per tokenizer.

What a trainer's input side sustains, measured as the trainer reads it: local files
(`data.files`; parquet shards, or jsonl where pyarrow is missing) written from the offline
Python-source corpus, read, tokenized and packed by `train.data.pipeline.PackedBatches` into
batches of `--rows` x (`--seq_len` + 1) tokens, with 0 (the packer's own thread) to
`--workers` worker processes. Tokenizers: the 32k SentencePiece model of the benchmarks
(`benchmarks.common.cli_run.DEFAULT_TOKENIZER`, trained offline if missing) and a 32k byte-level BPE
`tokenizer.json` trained here with the `tokenizers` library.

    python -m benchmarks.data_pipeline --out=benchmarks/results/h100/data_pipeline.json \
        --plot=docs/images/data_pipeline.png
    python -m benchmarks.data_pipeline --replot=RESULTS.json --plot=PNG   # the plot of a result

Reference: one H100 trains the sparse 0.5B model at ~180k tokens/s and the `small` config at
~370k tokens/s; 4 H100s on `small` need ~1.5M tokens/s, 8 need ~3M.
"""

import json
import os
import platform
import tempfile
import time

from absl import app
from absl import flags

from benchmarks.common import cli_run


def _define_flags():
  flags.DEFINE_string("out", None, "results JSON")
  flags.DEFINE_string("plot", None, "PNG of tokens/s by worker count against what GPUs consume")
  flags.DEFINE_string("replot", None, "draw --plot from this results JSON and exit")
  flags.DEFINE_list("workers", None, "worker counts (default 0, 1, 2, 4, ... up to the cores)")
  flags.DEFINE_list("tokenizers", ["sentencepiece", "hf"], "sentencepiece and/or hf")
  flags.DEFINE_string("spm_model", None, "a SentencePiece .model to use instead of training "
                      "the benchmarks' 32k one")
  flags.DEFINE_integer("rows", 8, "rows per batch")
  flags.DEFINE_integer("seq_len", 2048, "tokens per row (+1)")
  flags.DEFINE_float("seconds", 8.0, "measured time per cell, after a warm-up batch")
  flags.DEFINE_integer("shards", 16, "files the corpus is written to")
  flags.DEFINE_integer("max_docs", 20000, "documents of the corpus written")
  flags.DEFINE_string("keep", None, "folder to keep the shards and the tokenizer.json in "
                      "(for a training run on them)")
  flags.DEFINE_bool("smoke", False, "CPU smoke mode: the stdlib corpus, small vocabularies, "
                    "0 and 2 workers, short cells")


def _write_shards(docs: list[str], d: str, shards: int) -> tuple[str, str]:
  """(glob, format) of `docs` written to `shards` files: parquet where pyarrow imports."""
  try:
    import pyarrow as pa  # pylint: disable=import-outside-toplevel
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  except ImportError:
    pa = None
  for s in range(shards):
    part = docs[s::shards]
    if pa is not None:
      pq.write_table(pa.table({"text": part}), os.path.join(d, f"part-{s:05d}.parquet"),
                     row_group_size=1024)
    else:
      with open(os.path.join(d, f"part-{s:05d}.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in part)
  fmt = "parquet" if pa is not None else "jsonl"
  return os.path.join(d, f"part-*.{fmt}"), fmt


def _measure(source, tokenizer, workers: int, rows: int, seq_len: int,
             seconds: float) -> dict:
  from train.data import pipeline  # pylint: disable=import-outside-toplevel
  packer = pipeline.PackedBatches(source, tokenizer, seq_len=seq_len, rows=rows, seed=0,
                                  workers=workers)
  try:
    t0 = time.perf_counter()
    packer.next_batch()   # workers started and their pipelines full
    start_s = time.perf_counter() - t0
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
      packer.next_batch()
      n += 1
    dt = time.perf_counter() - t0
  finally:
    packer.close()
  return {"workers": workers, "batches": n, "seconds": round(dt, 2),
          "first_batch_s": round(start_s, 2),
          "tokens_per_s": round(n * rows * (seq_len + 1) / dt)}


# Tokens/s a training run consumes: the sparse 0.5B model on one
# H100, and the `small` config on 4 and on 8 H100s.
CONSUMERS = (("0.5B sparse, 1 H100", 180e3), ("small, 4 H100", 1.5e6), ("small, 8 H100", 3e6))


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for name in dict.fromkeys(c["tokenizer"] for c in result["cells"]):
    cells = [c for c in result["cells"] if c["tokenizer"] == name]
    ax.plot([c["workers"] for c in cells], [c["tokens_per_s"] / 1e6 for c in cells], "o-",
            label=name)
  for label, rate in CONSUMERS:
    ax.axhline(rate / 1e6, color="grey", lw=0.8, ls="--")
    ax.text(0, rate / 1e6, f" {label}", va="bottom", fontsize=8, color="grey")
  ax.set_xlabel("tokenizing worker processes (0: in the packer's process)")
  ax.set_ylabel("million tokens/s, packed")
  ax.set_title(f"Input pipeline, {result['format']} shards: {result['device']}, "
               f"{result['cpus']} cores", fontsize=10)
  ax.legend(loc="upper left", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  fl = flags.FLAGS
  if fl.replot:
    with open(fl.replot) as f:
      plot(json.load(f), fl.plot)
    return
  from train.corpus import text_corpus  # pylint: disable=import-outside-toplevel
  from train.data import files as files_lib  # pylint: disable=import-outside-toplevel
  from train.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  cpus = os.cpu_count() or 1
  dataset = text_corpus.NAME if fl.smoke else cli_run.DEFAULT_DATASET
  vocab = 500 if fl.smoke else 32000
  if fl.workers:
    counts = [int(w) for w in fl.workers]
  elif fl.smoke:
    counts = [0, 2]
  else:
    counts = [0, 1, 2, 4] + [w for w in (8, 12, 16) if w <= cpus]
  seconds = 1.0 if fl.smoke else fl.seconds
  docs = [t for _, t in text_corpus.iter_documents("train", dataset)][:fl.max_docs]
  work = fl.keep or tempfile.mkdtemp(prefix="twell_data_pipeline_")
  os.makedirs(work, exist_ok=True)
  pattern, fmt = _write_shards(docs, work, 4 if fl.smoke else fl.shards)
  source = files_lib.FileSource(pattern)
  toks = {}
  for name in fl.tokenizers:
    if name == "sentencepiece":
      if fl.spm_model:
        model = fl.spm_model
      elif fl.smoke:
        from train.corpus import build_tokenizer  # pylint: disable=import-outside-toplevel,reimported
        model = build_tokenizer.build(os.path.join(work, "spm"), dataset=dataset,
                                      vocab_size=vocab, max_bytes=1 << 20)["model"]
      else:
        model = cli_run.tokenizer_record(cli_run.DEFAULT_TOKENIZER, dataset)["model"]
      toks[f"sentencepiece {vocab}"] = tokenizer_lib.SentencePieceTokenizer(model)
    elif name == "hf":
      from train.corpus import build_tokenizer  # pylint: disable=import-outside-toplevel
      toks[f"bpe tokenizer.json {vocab}"] = tokenizer_lib.HFTokenizer(
          build_tokenizer.build_bpe_json(work, docs[:4000], vocab))
    else:
      raise app.UsageError(f"--tokenizers: unknown {name!r}")
  result = {"device": cli_run.device_name(), "cpus": cpus, "cpu": platform.processor(),
            "corpus": dataset, "documents": len(source), "format": fmt, "shards": fl.shards,
            "batch": [fl.rows, fl.seq_len + 1], "cells": []}
  for name, tok in toks.items():
    for w in counts:
      cell = dict(tokenizer=name, **_measure(source, tok, w, fl.rows, fl.seq_len, seconds))
      result["cells"].append(cell)
      print(f"{name:28s} workers {w:2d}: {cell['tokens_per_s'] / 1e6:6.2f}M tokens/s "
            f"({cell['batches']} batches in {cell['seconds']} s; first batch "
            f"{cell['first_batch_s']} s)", flush=True)
  best = {n: max(c["tokens_per_s"] for c in result["cells"] if c["tokenizer"] == n)
          for n in toks}
  result["best_tokens_per_s"] = best
  if fl.out:
    os.makedirs(os.path.dirname(os.path.abspath(fl.out)), exist_ok=True)
    with open(fl.out, "w") as f:
      json.dump(result, f, indent=1)
  if fl.plot:
    plot(result, fl.plot)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
