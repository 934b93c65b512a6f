"""Tests for the input pipeline: tokenizer, offline corpus, packing, resume."""

import collections
import json
import os
import pathlib
import pickle
import sys
from unittest import mock

import ml_collections
import numpy as np
from absl.testing import absltest

import train_test_util as tu
from train.data import pipeline as data
from train.data import tokenizer as tokenizer_lib
from train.corpus import text_corpus


def _data_cfg(use_tfds: bool):
  return ml_collections.ConfigDict(dict(
      dataset=text_corpus.NAME, data_dir=tu.offline_data_dir(),
      use_tfds=use_tfds, text_key="text", train_split="train",
      eval_split="validation", tokenizer="byte", spm_model=None))


class ByteTokenizerTest(absltest.TestCase):

  def test_round_trip_and_range(self):
    tok = tokenizer_lib.ByteTokenizer()
    text = "héllo, wörld\n\tend"
    ids = tok.encode(text)
    self.assertEqual(ids.dtype, np.int32)
    self.assertTrue(np.all(ids >= 3) and np.all(ids < tok.vocab_size))
    self.assertEqual(tok.decode(ids), text)
    self.assertLen(ids, len(text.encode("utf-8")))


class SentencePieceTokenizerTest(absltest.TestCase):

  def test_model_file_trained_offline_tokenizes_and_packs(self):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    texts = [t for _, t in list(text_corpus.iter_documents("train"))[:400]]
    path = self.create_tempdir().full_path + "/tiny.model"
    with open(path, "wb") as f:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(texts), model_writer=f, vocab_size=300,
          model_type="bpe", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
          minloglevel=2)
    cfg = _data_cfg(False)
    cfg.update(tokenizer="sentencepiece", spm_model=path)
    tok = tokenizer_lib.make_tokenizer(cfg)
    self.assertEqual(tok.vocab_size, 300)
    self.assertEqual(tok.eos_id, 1)
    text = "Return the number of items in a container."
    ids = tok.encode(text)
    self.assertTrue(np.all((ids >= 0) & (ids < 300)))
    self.assertLess(len(ids), len(text))          # merges, not bytes
    self.assertEqual(tok.decode(ids), text)
    packer = data.PackedBatches(data.make_source(cfg, "validation"), tok,
                                seq_len=31, rows=4, seed=0)
    batch = packer.next_batch()
    self.assertTrue(np.all(batch < 300))
    # A batch encodes on several threads in this process, one in a copy sent to a worker
    # process; the ids are the same either way.
    self.assertEqual(tok.num_threads, tokenizer_lib.SPM_THREADS)
    copy = pickle.loads(pickle.dumps(tok))
    self.assertEqual(copy.num_threads, 1)
    threaded = tokenizer_lib.SentencePieceTokenizer(path, num_threads=4)
    for a, b in zip(threaded.encode_batch(texts[:64]), copy.encode_batch(texts[:64])):
      np.testing.assert_array_equal(a, b)


class OfflineCorpusTest(absltest.TestCase):

  def test_splits_are_disjoint_and_nonempty(self):
    train = list(text_corpus.iter_documents("train"))
    val = list(text_corpus.iter_documents("validation"))
    self.assertGreater(len(train), 1000)
    self.assertGreater(len(val), 20)
    self.assertEmpty({t for _, t in train} & {t for _, t in val})
    self.assertTrue(all(len(t) >= text_corpus.MIN_CHARS for _, t in val))

  def test_parsed_once_then_read_from_the_cache_file(self):
    cache = self.create_tempdir().full_path
    parsed = tuple(text_corpus._parse_docstrings(text_corpus._stdlib_files()))
    try:
      with mock.patch.dict(os.environ, {"TWELL_JAX_CORPUS_CACHE": cache}):
        text_corpus._docstrings.cache_clear()
        self.assertEqual(text_corpus._docstrings(), parsed)
        (name,) = os.listdir(cache)
        self.assertTrue(name.startswith(text_corpus.NAME) and name.endswith(".json"), name)
        with open(os.path.join(cache, name), "w") as f:
          json.dump([["a.py:0", "the cached corpus is read, not parsed again"]], f)
        text_corpus._docstrings.cache_clear()
        self.assertEqual(text_corpus._docstrings(),
                         (("a.py:0", "the cached corpus is read, not parsed again"),))
        with open(os.path.join(cache, name), "w") as f:
          f.write('[["cut short')                 # a damaged file: parsed and written again
        text_corpus._docstrings.cache_clear()
        self.assertEqual(text_corpus._docstrings(), parsed)
        with open(os.path.join(cache, name)) as f:
          self.assertLen(json.load(f), len(parsed))
      with mock.patch.dict(os.environ, {"TWELL_JAX_CORPUS_CACHE": ""}):
        self.assertIsNone(text_corpus._cache_path(text_corpus._stdlib_files()))
    finally:
      text_corpus._docstrings.cache_clear()

  def test_fingerprint_read_once_then_from_the_cache(self):
    """A split's fingerprint is kept in the corpus cache, keyed by the corpus's files: the
    second call reads no document; another listing (a file changed) reads the corpus again."""
    cache = self.create_tempdir().full_path
    name = text_corpus.NAME
    with mock.patch.dict(os.environ, {"TWELL_JAX_CORPUS_CACHE": cache}):
      first = text_corpus.fingerprint(name, "validation")
      self.assertEqual(first["documents"], len(list(text_corpus.iter_documents("validation"))))
      self.assertLen([f for f in os.listdir(cache) if f.startswith("fingerprint-")], 1)
      with mock.patch.object(text_corpus, "iter_documents", side_effect=AssertionError):
        self.assertEqual(text_corpus.fingerprint(name, "validation"), first)
      files = text_corpus._stdlib_files()
      before = text_corpus._fingerprint_path(name, "validation")
      changed = [(files[0][0] + "x", files[0][1])] + files[1:]   # a file moved
      with mock.patch.object(text_corpus, "_stdlib_files", return_value=changed):
        self.assertNotEqual(text_corpus._fingerprint_path(name, "validation"), before)
        self.assertEqual(text_corpus.fingerprint(name, "validation"), first)
      self.assertLen([f for f in os.listdir(cache) if f.startswith("fingerprint-")], 2)

  def test_tfds_and_generator_readers_agree(self):
    tok = tokenizer_lib.ByteTokenizer()
    batches = []
    for use_tfds in (True, False):
      src = data.make_source(_data_cfg(use_tfds), "validation")
      packer = data.PackedBatches(src, tok, seq_len=31, rows=4, seed=3)
      batches.append([packer.next_batch() for _ in range(3)])
    for a, b in zip(*batches):
      np.testing.assert_array_equal(a, b)


class SourceCorpusTest(absltest.TestCase):
  """The larger offline corpora: source files, held out by content, each content once."""

  def test_no_held_out_text_in_train(self):
    for name in (text_corpus.SITE_NAME, text_corpus.NAME):
      with self.subTest(name):
        keys = {split: [text_corpus.content_key(t)
                        for _, t in text_corpus.iter_documents(split, name)]
                for split in text_corpus.SPLITS}
        self.assertEmpty(set(keys["train"]) & set(keys["validation"]))
        for split, ks in keys.items():
          self.assertLen(set(ks), len(ks), f"{split} repeats a document")
        # The installation holds copies of one text at several paths (the test is only
        # meaningful if it does); each is read once, in one split.
        paths = collections.defaultdict(list)
        for key, text in text_corpus._iter_all(name):   # pylint: disable=protected-access
          paths[text_corpus.content_key(text)].append(key)
        copied = [ck for ck, where in paths.items() if len(where) > 1]
        self.assertNotEmpty(copied)
        both = keys["train"] + keys["validation"]
        for ck in copied:
          self.assertEqual(both.count(ck), 1)

  def test_splits_and_fingerprint(self):
    name = text_corpus.SOURCE_NAME
    train = [k for k, _ in text_corpus.iter_documents("train", name)]
    val = [k for k, _ in text_corpus.iter_documents("validation", name)]
    self.assertGreater(len(train), 500)
    self.assertNotEmpty(val)
    self.assertEmpty(set(train) & set(val))
    self.assertLess(len(val), len(train) / 20)              # about 1 file in 50
    self.assertTrue(all(k.startswith("stdlib/") and k.endswith(".py") for k in train))
    # `documents`: the first call of a process reads every file, the second only its split's;
    # the same documents in either order.
    for order in ((("train", train), ("validation", val)), (("validation", val), ("train", train))):
      text_corpus._SPLIT_KEYS.clear()  # pylint: disable=protected-access
      for split, keys in order:
        self.assertEqual([k for k, _ in text_corpus.documents(split, name)], keys)
    fp = text_corpus.fingerprint(name, "validation")
    self.assertEqual(fp["documents"], len(val))
    self.assertEqual(fp, text_corpus.fingerprint(name, "validation"))   # stable
    self.assertGreater(text_corpus.fingerprint(name, "train")["bytes"], 10 << 20)

  def test_the_files_are_listed_once_per_process(self):
    """Opening a source corpus's split (its files, and the cache key made of them) lists the
    installation's files once: the listing is a tenth of a second to a second at a run's
    start, on the data's path to the first step."""
    listing = text_corpus._source_files  # pylint: disable=protected-access
    listing.cache_clear()
    text_corpus.document_files("validation", text_corpus.SOURCE_NAME)
    self.assertEqual(listing.cache_info().misses, 1)

  def test_splits_cached_and_documents_read_on_demand(self):
    """Which split each file is in is kept in the corpus cache: a second process (the
    process's own copy cleared) opens a split without reading the corpus, and its documents,
    read as asked for, are `iter_documents`' in order. A file gone after the opening is a
    clear error, not a document skipped."""
    name = text_corpus.SOURCE_NAME
    cache = self.create_tempdir().full_path
    val = list(text_corpus.iter_documents("validation", name))
    with mock.patch.dict(os.environ, {"TWELL_JAX_CORPUS_CACHE": cache}):
      text_corpus._SPLIT_KEYS.clear()  # pylint: disable=protected-access
      try:
        keys = text_corpus.split_keys(name)
        self.assertEqual(list(keys["validation"]), [k for k, _ in val])
        self.assertLen([f for f in os.listdir(cache) if f.startswith(f"splits-{name}")], 1)
        text_corpus._SPLIT_KEYS.clear()  # pylint: disable=protected-access
        with mock.patch.object(text_corpus, "_iter_split_documents",
                               side_effect=AssertionError("the corpus was read")):
          files = text_corpus.document_files("validation", name)
          self.assertLen(files, len(val))
          self.assertEqual(files.get_many([2, 0]), [val[2][1], val[0][1]])
          self.assertEqual(files.get_many(range(len(val))), [t for _, t in val])
          self.assertEqual(text_corpus.documents("validation", name), tuple(val))
        # A damaged cache file is read past: the corpus is read and the file written again.
        (cached,) = [f for f in os.listdir(cache) if f.startswith(f"splits-{name}")]
        with open(os.path.join(cache, cached), "w") as f:
          f.write('{"train": ["cut')
        text_corpus._SPLIT_KEYS.clear()  # pylint: disable=protected-access
        self.assertEqual(text_corpus.split_keys(name), keys)
        with self.assertRaisesRegex(ValueError, "parsed"):
          text_corpus.document_files("train", text_corpus.NAME)
      finally:
        text_corpus._SPLIT_KEYS.clear()  # pylint: disable=protected-access
    gone = text_corpus.DocumentFiles([pathlib.Path(cache) / "gone.py"])
    with self.assertRaisesRegex(OSError, "changed after the run opened it"):
      gone.get_many([0])

  def test_tfds_and_generator_readers_agree(self):
    tok = tokenizer_lib.ByteTokenizer()
    batches = []
    for use_tfds in (True, False):
      cfg = _data_cfg(use_tfds)
      cfg.dataset = text_corpus.SOURCE_NAME
      packer = data.PackedBatches(data.make_source(cfg, "validation"), tok, seq_len=63,
                                  rows=4, seed=3)
      batches.append([packer.next_batch() for _ in range(2)])
    for a, b in zip(*batches):
      np.testing.assert_array_equal(a, b)


class BuildTokenizerTest(absltest.TestCase):
  """`train.corpus.build_tokenizer`: trained offline on the source corpus, exact round trips
  of code (indentation, newlines, any byte), a record of the corpus it saw."""

  def test_build_round_trip_and_record(self):
    from train.corpus import build_tokenizer  # pylint: disable=g-import-not-at-top
    out = self.create_tempdir().full_path + "/tok/py"
    rec = build_tokenizer.build(out, dataset=text_corpus.SOURCE_NAME, vocab_size=600,
                                max_bytes=1 << 20, threads=2)
    self.assertEqual(rec["corpus"], text_corpus.fingerprint(text_corpus.SOURCE_NAME, "train"))
    cfg = _data_cfg(False)
    cfg.update(tokenizer="sentencepiece", spm_model=rec["model"])
    tok = tokenizer_lib.make_tokenizer(cfg)
    self.assertEqual((tok.vocab_size, tok.eos_id), (600, 1))
    texts = [t for _, t in text_corpus.iter_documents("validation", text_corpus.SOURCE_NAME)]
    texts.append("def f(x):\n\t  return x  # \u00e9\u4e2d \U0001f600\n\n\n")
    for text in texts:
      ids = tok.encode(text)
      self.assertEqual(tok.decode(ids), text)
    self.assertLess(sum(len(tok.encode(t)) for t in texts),
                    sum(len(t.encode()) for t in texts) / 1.5)  # merges, not bytes
    mtime = os.path.getmtime(rec["model"])
    self.assertEqual(build_tokenizer.build(out, dataset=text_corpus.SOURCE_NAME,
                                           vocab_size=600, max_bytes=1 << 20), rec)
    self.assertEqual(os.path.getmtime(rec["model"]), mtime)    # kept, not retrained


class OfflinePrepareTest(absltest.TestCase):

  def test_two_processes_prepare_a_fresh_data_dir_at_once(self):
    """Two runs started together on a fresh machine both prepare the offline corpus; without
    the lock the second one's rename of its temporary build failed (Directory not empty)."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    data_dir = self.create_tempdir().full_path
    code = ("import sys; from train.corpus import tfds_offline; "
            "b = tfds_offline.prepare(sys.argv[1]); print(b.info.splits['train'].num_examples)")
    env = dict(os.environ, PYTHONPATH=tu.REPO, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", code, data_dir], env=env, cwd=tu.REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
      self.assertEqual(p.returncode, 0, err[-2000:])
    counts = [int(out.split()[-1]) for out, _ in outs]   # the last line; tfds logs before it
    self.assertEqual(counts[0], counts[1])
    self.assertGreater(counts[0], 1000)


class TfdsByNameTest(absltest.TestCase):

  def test_any_tfds_text_dataset_by_name(self):
    # mock_data serves tfds.data_source("lm1b") without TF or a download.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    cfg = _data_cfg(True)
    cfg.update(dataset="lm1b", data_dir=None, eval_split="test")
    with tfds.testing.mock_data(num_examples=16,
                                policy=tfds.testing.MockPolicy.USE_CODE):
      src = data.make_source(cfg, "train")
      self.assertLen(src, 16)
      packer = data.PackedBatches(src, tokenizer_lib.ByteTokenizer(), seq_len=15,
                                  rows=2, seed=0, shard_index=1,
                                  shard_count=2)
      batch = packer.next_batch()
    self.assertEqual(batch.shape, (2, 16))
    self.assertIn(tokenizer_lib.EOS_ID, batch)


class ImportBeforeThreadsTest(absltest.TestCase):

  def test_tfds_imported_before_the_fresh_runs_threads_start(self):
    # tfds's import swaps builtins.__import__ for every thread (etils lazy imports): a step
    # traced on a thread meanwhile got a broken module and the run aborted. A fresh run
    # must import it before `_fresh_state_ahead` and `_first_step_ahead` start their threads;
    # a run on the user's files never imports it.
    code = """
import sys
from configs import tiny
from train.training import loop
seen = []
def stop(*args):
  seen.append("tensorflow_datasets" in sys.modules)
  raise KeyboardInterrupt
loop._fresh_state_ahead = stop
cfg = tiny.get_config()
cfg.data.update(data_dir=sys.argv[2], use_tfds=True)
if sys.argv[3] != "-":
  cfg.data.files = sys.argv[3]
try:
  loop.train_and_evaluate(cfg, sys.argv[1])
except KeyboardInterrupt:
  pass
print(seen, "tensorflow_datasets" in sys.modules)
"""
    tmp = self.create_tempdir()
    corpus = tmp.create_file("c.txt", content="a b c\n" * 100).full_path
    for files, expect in (("-", "[True] True"), (corpus, "[False] False")):
      wd = os.path.join(tmp.full_path, f"wd{len(files)}")
      out = tu.run([sys.executable, "-c", code, wd, tu.offline_data_dir(), files])
      self.assertEqual(out.returncode, 0, out.stderr[-3000:])
      self.assertEqual(out.stdout.strip().splitlines()[-1], expect, files)


class PackingTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.src = data.make_source(_data_cfg(False), "validation")
    self.tok = tokenizer_lib.ByteTokenizer()

  def _packer(self, **kw):
    args = dict(seq_len=15, rows=3, seed=0)
    args.update(kw)
    return data.PackedBatches(self.src, self.tok, **args)

  def test_shapes_and_stream_is_concatenated_documents(self):
    p = self._packer(shuffle=False)
    b = p.next_batch()
    self.assertEqual(b.shape, (3, 16))
    self.assertEqual(b.dtype, np.int32)
    first = self.tok.encode(self.src.get_many([0])[0])
    expected = np.concatenate([first, [tokenizer_lib.EOS_ID]])[:48]
    np.testing.assert_array_equal(b.reshape(-1)[:len(expected)], expected)

  def test_seeded_shuffle_is_deterministic_and_seed_dependent(self):
    a = [self._packer(seed=1).next_batch() for _ in range(2)]
    b = [self._packer(seed=1).next_batch() for _ in range(2)]
    c = self._packer(seed=2).next_batch()
    np.testing.assert_array_equal(a[0], b[0])
    self.assertFalse(np.array_equal(a[0], c))

  def test_state_round_trip_continues_the_same_stream(self):
    p = self._packer(seed=5)
    for _ in range(7):
      p.next_batch()
    saved = p.get_state()
    expected = [p.next_batch() for _ in range(4)]
    q = self._packer(seed=5)
    q.set_state(saved)
    for e in expected:
      np.testing.assert_array_equal(q.next_batch(), e)

  def test_epochs_wrap_and_reshuffle(self):
    p = self._packer(seq_len=255, rows=8, seed=0)
    while p.state.epoch == 0:
      p.next_batch()
    self.assertEqual(p.state.epoch, 1)
    self.assertFalse(np.array_equal(p._doc_order(0), p._doc_order(1)))  # pylint: disable=protected-access

  def test_process_shards_partition_the_documents(self):
    orders = [self._packer(shard_index=i, shard_count=3)._doc_order(0)  # pylint: disable=protected-access
              for i in range(3)]
    allidx = np.concatenate(orders)
    self.assertLen(allidx, len(self.src))
    self.assertLen(set(allidx.tolist()), len(self.src))

  def test_non_repeating_eval_stream_ends(self):
    p = self._packer(seq_len=1023, rows=16, shuffle=False, repeat=False)
    n = 0
    while p.next_batch() is not None:
      n += 1
      self.assertLess(n, 10_000)
    self.assertGreater(n, 0)

  def test_prefetcher_pairs_each_batch_with_the_state_after_it(self):
    p = self._packer(seed=9)
    pf = data.Prefetcher(p, depth=3)
    try:
      b1, s1 = next(pf)
      b2, _ = next(pf)
    finally:
      pf.close()
    q = self._packer(seed=9)
    np.testing.assert_array_equal(q.next_batch(), b1)
    self.assertEqual(q.get_state(), s1)
    np.testing.assert_array_equal(q.next_batch(), b2)


if __name__ == "__main__":
  absltest.main()
