"""Local files as training data (`data.files`), Hugging Face tokenizer.json tokenization and
the tokenizing worker processes.

* Every format (.jsonl with blank lines, .jsonl.gz, .parquet of several row groups, .txt by
  paragraph, line or file) gives its documents in order; the epoch order permutes every
  document, differs between epochs, and the processes' shares partition the documents.
* The held-out split (a fraction of the documents, or `data.eval_files`) never overlaps the
  training documents.
* Bad input is one `DataError` naming the file (and line): a glob matching nothing, a missing
  or non-text field, an empty file, invalid UTF-8, an unknown extension, eval files that are
  also training files.
* Worker processes give the same batches and states as tokenizing in the packer's thread, and
  a stream resumed from a state continues it exactly, at any worker count; a worker that
  fails is an error in the packer, not a hang.
* Through the CLI: train on jsonl + parquet + txt + jsonl.gz files with a tokenizer.json and
  two workers, SIGKILL, rerun: the final parameters equal an uninterrupted run's; the log
  shows the data wait. A glob matching nothing and a tokenizer larger than model.vocab_size
  stop the command with one line, before anything is trained or written.
"""

import gzip
import json
import os
import signal
import subprocess
import tempfile
import time

import ml_collections
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import train_test_util as tu
from train import errors
from train.data import files as files_lib
from train.data import pipeline as data_lib
from train.data import tokenizer as tokenizer_lib
from train.data import workers as workers_lib


def _documents(n: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  words = ["def", "return", "the", "value", "of", "x", "ü", "名前", "=", "(", ")", ":"]
  return [" ".join(rng.choice(words, rng.integers(1, 120))) + f" #{i}" for i in range(n)]


def _write_corpus(d: str, docs: list[str]) -> list[str]:
  """docs split over a.jsonl (blank lines between), b.jsonl.gz, c.parquet (row groups of 50)
  and d.txt (blank-line separated paragraphs), in this order (their sorted order)."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  q = len(docs) // 4
  with open(os.path.join(d, "a.jsonl"), "w") as f:
    for t in docs[:q]:
      f.write(json.dumps({"id": 1, "text": t}) + "\n \n")
  with gzip.open(os.path.join(d, "b.jsonl.gz"), "wt", encoding="utf-8") as f:
    for t in docs[q:2 * q]:
      f.write(json.dumps({"text": t}) + "\n")
  pq.write_table(pa.table({"text": docs[2 * q:3 * q]}), os.path.join(d, "c.parquet"),
                 row_group_size=50)
  with open(os.path.join(d, "d.txt"), "w") as f:
    f.write("\n\n".join(docs[3 * q:]) + "\n")
  return [os.path.join(d, n) for n in ("a.jsonl", "b.jsonl.gz", "c.parquet", "d.txt")]


class FileSourceTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.dir = tempfile.mkdtemp(prefix="twell_files_")
    cls.docs = _documents(400)
    cls.paths = _write_corpus(cls.dir, cls.docs)

  def test_every_format_gives_its_documents_in_order(self):
    src = files_lib.FileSource(os.path.join(self.dir, "*"))
    self.assertEqual(src.paths, self.paths)
    self.assertLen(src, 400)
    self.assertEqual(src.get_many(range(400)), self.docs)
    self.assertEqual(src.get_many([399, 0, 250, 120]),
                     [self.docs[i] for i in (399, 0, 250, 120)])

  @parameterized.parameters(("paragraph", ["a b", "c\nd"]), ("line", ["a b", "c", "d"]),
                            ("file", ["a b\n\nc\nd\n"]))
  def test_text_units(self, unit, expected):
    path = os.path.join(self.create_tempdir().full_path, "t.txt")
    with open(path, "w") as f:
      f.write("a b\n\nc\nd\n")
    self.assertEqual(files_lib.FileSource(path, text_unit=unit).get_many(
        range(len(expected))), expected)

  def test_epoch_order_permutes_and_processes_partition(self):
    src = files_lib.FileSource(",".join(self.paths))
    e0 = src.epoch_order(7, 0, 0, 1, True)
    self.assertEqual(sorted(e0.tolist()), list(range(400)))
    self.assertFalse(np.array_equal(e0, src.epoch_order(7, 1, 0, 1, True)))
    np.testing.assert_array_equal(e0, files_lib.FileSource(
        ",".join(self.paths)).epoch_order(7, 0, 0, 1, True))
    np.testing.assert_array_equal(src.epoch_order(7, 0, 0, 1, False), np.arange(400))
    for procs in (2, 3, 40):   # 40 > the 7 blocks: documents dealt instead
      shares = [src.epoch_order(7, 0, p, procs, True).tolist() for p in range(procs)]
      self.assertEqual(sorted(sum(shares, [])), list(range(400)), procs)

  def test_held_out_documents_are_never_trained_on(self):
    cfg = ml_collections.ConfigDict(dict(
        files=os.path.join(self.dir, "*"), eval_files="", eval_fraction=0.1,
        text_key="text", text_unit="paragraph"))
    train, held = files_lib.open_splits(cfg)
    self.assertEqual((len(train), len(held)), (360, 40))
    self.assertEqual(held.get_many(range(40)), self.docs[360:])
    self.assertEqual(sorted(train.epoch_order(0, 0, 0, 1, True).tolist()), list(range(360)))
    self.assertEqual(train.get_many(range(360)), self.docs[:360])
    cfg.update(files=",".join(self.paths[:3]), eval_files=self.paths[3])
    train, held = files_lib.open_splits(cfg)
    self.assertEqual((len(train), len(held)), (300, 100))
    cfg.eval_files = self.paths[2]
    with self.assertRaisesRegex(errors.DataError, "c.parquet"):
      files_lib.open_splits(cfg)

  def test_jsonl_index_is_kept_until_the_file_changes(self):
    d, cache = self.create_tempdir().full_path, self.create_tempdir().full_path
    path = os.path.join(d, "k.jsonl")
    with open(path, "w") as f:
      f.writelines(json.dumps({"text": t}) + "\n" for t in self.docs[:30])
    self.assertLen(files_lib.FileSource(path, index_dir=cache), 30)
    self.assertLen(os.listdir(cache), 1)
    with absltest.mock.patch.object(files_lib._Jsonl, "_index", side_effect=AssertionError):
      self.assertEqual(files_lib.FileSource(path, index_dir=cache).get_many(range(30)),
                       self.docs[:30])   # read from the cache, not scanned
    with open(path, "a") as f:
      f.write(json.dumps({"text": "one more"}) + "\n")
    src = files_lib.FileSource(path, index_dir=cache)   # size changed: scanned again
    self.assertEqual(src.get_many([30]), ["one more"])

  def _bad(self, name: str, content: bytes | None = None, **kwargs):
    d = self.create_tempdir().full_path
    path = os.path.join(d, name)
    if content is not None:
      with open(path, "wb") as f:
        f.write(content)
    return lambda: files_lib.FileSource(path, **kwargs)

  @parameterized.named_parameters(
      ("glob_matches_nothing", "none*.jsonl", None, r"none\*.jsonl' matches no file"),
      ("missing_field", "m.jsonl", b'{"content": "x"}\n', r"m.jsonl:1: no field 'text'"),
      ("field_not_text", "n.jsonl", b'{"text": 3}\n', r"n.jsonl:1: field 'text' is int"),
      ("not_json", "j.jsonl", b'\n{"text": \n', r"j.jsonl:2: not a JSON object"),
      ("empty_file", "e.jsonl", b"\n  \n", r"e.jsonl: no documents"),
      ("empty_txt", "e.txt", b"", r"e.txt: no documents"),
      ("invalid_utf8_jsonl", "u.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n',
       r"u.jsonl:2: invalid UTF-8"),
      ("invalid_utf8_txt", "u.txt", b"fine\n\xc3\x28\n", r"u.txt:2: invalid UTF-8"),
      ("unknown_extension", "x.csv", b"a,b\n", r"x.csv: not one of the formats"),
  )
  def test_bad_input_names_the_file(self, name, content, message):
    with self.assertRaisesRegex(errors.DataError, message):
      self._bad(name, content)()

  def test_bad_parquet_and_gzip_name_the_file(self):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    d = self.create_tempdir().full_path
    pq.write_table(pa.table({"body": ["x"]}), os.path.join(d, "p.parquet"))
    with self.assertRaisesRegex(errors.DataError, r"p.parquet: no column 'text'.*body"):
      files_lib.FileSource(os.path.join(d, "p.parquet"))
    with self.assertRaisesRegex(errors.DataError, r"g.jsonl.gz: not a gzip file"):
      self._bad("g.jsonl.gz", b"plain text")()
    with self.assertRaisesRegex(errors.DataError, r"k.jsonl.gz:1: no field 'text'"):
      self._bad("k.jsonl.gz", gzip.compress(b'{"t": "x"}\n'))()


class WorkersTest(absltest.TestCase):

  def test_workers_give_the_same_stream_and_resume_exactly(self):
    d = self.create_tempdir().full_path
    docs = _documents(40, seed=1)
    _write_corpus(d, docs)
    tok = tokenizer_lib.HFTokenizer(tu.write_bpe_tokenizer(
        self.create_tempdir().full_path, docs, 300))
    self.assertEqual(tok.eos_token, "<|endoftext|>")
    self.assertEqual(tok.decode(tok.encode(docs[5])), docs[5])
    src = files_lib.FileSource(os.path.join(d, "*"))

    def stream(workers, n, state=None):
      packer = data_lib.PackedBatches(src, tok, seq_len=63, rows=4, seed=5, workers=workers)
      try:
        if state is not None:
          packer.set_state(state)
        return [packer.next_batch() for _ in range(n)], packer.get_state()
      finally:
        packer.close()

    ref, ref_state = stream(0, 30)   # more than one epoch of these 40 documents
    self.assertGreater(ref_state["epoch"], 0)
    got, got_state = stream(2, 30)
    self.assertEqual(got_state, ref_state)
    np.testing.assert_array_equal(np.stack(got), np.stack(ref))
    _, mid = stream(0, 5)
    rest, rest_state = stream(3, 25, mid)
    np.testing.assert_array_equal(np.stack(rest), np.stack(ref[5:]))
    self.assertEqual(rest_state, ref_state)

  def test_a_worker_that_fails_is_an_error_not_a_hang(self):
    d = self.create_tempdir().full_path
    tok = tokenizer_lib.HFTokenizer(tu.write_bpe_tokenizer(d, _documents(20), 280))
    os.remove(tok.path)   # the worker rebuilds the tokenizer from its file: it cannot
    pool = workers_lib.EncoderPool(tok, 1)
    try:
      with self.assertRaisesRegex(workers_lib.WorkerError, "tokenizing worker 0 exited"):
        pool.submit(["some text"]).result(timeout=60)
    finally:
      pool.close()


STEPS = 8
FLAGS = (f"--config.num_train_steps={STEPS}", "--config.checkpoint_every=2",
         "--config.keep_checkpoints=5", "--config.eval_every=4", "--config.eval_batches=1",
         "--config.log_every=2", "--config.data.tokenizer=hf", "--config.data.workers=2",
         "--config.model.vocab_size=320")


def _final_params(wd):
  return tu.restore_params(wd, STEPS)


class FilesCliTest(absltest.TestCase):
  """The CLI on local files with a tokenizer.json (module docstring)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.dir = tempfile.mkdtemp(prefix="twell_files_")
    docs = _documents(600, seed=2)
    _write_corpus(cls.dir, docs)
    cls.tok = tu.write_bpe_tokenizer(os.path.join(cls.dir, "tok"), docs, 300)
    cls.flags = FLAGS + (f"--config.data.files={cls.dir}/*.jsonl*,{cls.dir}/*.parquet,"
                         f"{cls.dir}/*.txt", f"--config.data.tokenizer_file={cls.tok}",
                         "--config.data.eval_fraction=0.1")

  def _cmd(self, wd, *extra):
    return tu.main_cmd(wd, *self.flags, *extra)

  def test_train_sigkill_resume_same_state(self):
    ref = self.create_tempdir().full_path
    out = tu.run(self._cmd(ref))
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertRegex(out.stderr, r"data wait \d+\.\d%")
    self.assertIn('"loss"', out.stderr)   # evaluated on the held-out documents
    wd = self.create_tempdir().full_path
    proc = subprocess.Popen(self._cmd(wd), cwd=tu.REPO, env=tu.run_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not tu.checkpoint_steps(wd) and time.time() < deadline and proc.poll() is None:
      time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    self.assertEqual(proc.returncode, -signal.SIGKILL, "the run finished before the kill")
    self.assertLess(max(tu.checkpoint_steps(wd)), STEPS)
    out = tu.run(self._cmd(wd))
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    self.assertIn("Resumed from checkpoint step", out.stderr)
    self.assertTrue(tu.tree_equal(_final_params(wd), _final_params(ref)),
                    "the resumed run diverged from the uninterrupted one")

  def test_bad_input_stops_with_one_line_before_training(self):
    for extra, message in (
        (("--config.data.files=/nonexistent/*.parquet",), "matches no file"),
        (("--config.model.vocab_size=200",), "vocab_size"),
    ):
      wd = os.path.join(self.create_tempdir().full_path, "wd")
      out = tu.run(self._cmd(wd, *extra))
      self.assertEqual(out.returncode, 1, out.stderr[-2000:])
      last = out.stderr.strip().splitlines()[-1]
      self.assertTrue(last.startswith("error: ") and message in last, last)
      self.assertNotIn("Traceback", out.stderr)
      self.assertFalse(os.path.exists(os.path.join(wd, "checkpoints")), extra)
      self.assertFalse(os.path.exists(os.path.join(wd, "config.json")), extra)


if __name__ == "__main__":
  absltest.main()
