"""Tests for Hugging Face interop with a `tokenizer.json` tokenizer (data.tokenizer="hf"): a
Llama directory that ships one is imported and ReLUfied, trained, exported and read back with
the same ids; generation decodes with it; one that does not fit is one error. Where
transformers and torch are installed, they read the export."""

import filecmp
import importlib.util
import itertools
import json
import os
import shutil
import tempfile

import jax
import numpy as np
from absl.testing import absltest

import train_test_util as tu
from configs import relufy
from train import errors
from train.corpus import text_corpus
from train.data import tokenizer as tokenizer_lib
from train.hf import format as hf_format
from train.inference import generator
from train.hf import exporting
from train.inference import loading
from train.models import transformer as model_lib
from train.state import checkpointing
from train.hf import importing
from train.training import loop as train_lib
from train.state import trainer as trainer_lib

HAVE_TRANSFORMERS = all(importlib.util.find_spec(m) is not None
                        for m in ("transformers", "torch"))
SAMPLE = "def add(a, b):\n    return a + b  # héllo ✓\n"
EOS = "<|endoftext|>"
VOCAB = 416  # the model's; the tokenizer has 400 ids


def _data_fields(data) -> dict:
  return {k: data[k] for k in ("tokenizer", "tokenizer_file", "eos_token")}


def _read_json(path: str):
  with open(path) as f:
    return json.load(f)


class HFTokenizerTest(tu.FastCompile, absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp(prefix="twell_hf_tokenizer_")
    texts = [t for _, t in itertools.islice(text_corpus.iter_documents("train"), 60)]
    tok_dir = os.path.join(cls.tmp, "bpe")
    cls.tok_path = tu.write_bpe_tokenizer(tok_dir, texts, 400)
    cls.tok = tokenizer_lib.HFTokenizer(cls.tok_path)
    # A dense SiLU Llama directory as the Hub has them: config.json, weights, tokenizer.json
    # and a tokenizer_config.json naming only the eos_token (no twell_tokenizer.json).
    cfg = tu.micro_config(**{"model.vocab_size": VOCAB, "model.ffn_activation": "silu",
                             "model.ffn_implementation": "dense", "data.tokenizer": "hf",
                             "data.tokenizer_file": cls.tok_path})
    lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
    cls.params = lm.init_params(jax.random.key(0))
    cls.src = os.path.join(cls.tmp, "llama")
    exporting.write_hf_dir(cls.src, cls.params, cfg, cls.tok)
    os.remove(os.path.join(cls.src, hf_format.TWELL_TOKENIZER))
    shutil.copyfile(os.path.join(tok_dir, "tokenizer_config.json"),
                    os.path.join(cls.src, "tokenizer_config.json"))
    # ReLUfied from (a copy of) it for two steps, then exported.
    cls.relufy_src = os.path.join(cls.tmp, "llama_for_relufy")
    shutil.copytree(cls.src, cls.relufy_src)
    cls.relufied = os.path.join(cls.tmp, "relufied")
    train_lib.train_and_evaluate(cls._relufy_config(num_train_steps=2), cls.relufied)
    cls.export = os.path.join(cls.tmp, "export")
    cls.summary = exporting.export(cls.relufied, cls.export, step=2)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)
    super().tearDownClass()

  @classmethod
  def _relufy_config(cls, **overrides):
    cfg = relufy.get_config("tiny")
    cfg.data.update(seq_len=32, data_dir=tu.offline_data_dir())
    cfg.update(batch_size=8, log_every=1, eval_every=0, checkpoint_every=1, **overrides)
    cfg.init_from_hf.path = cls.relufy_src
    return cfg

  def _copy(self, hf_dir):
    path = os.path.join(self.create_tempdir().full_path, "hf")
    shutil.copytree(hf_dir, path)
    return path

  def _ids(self, tokenizer):
    return [int(i) for i in tokenizer.encode(SAMPLE)]

  def test_a_llama_directory_with_a_tokenizer_json_imports(self):
    src, wd = self._copy(self.src), self.create_tempdir().full_path
    self.assertEqual(importing.import_checkpoint(src, wd, tu.micro_config())["tokenizer"], "hf")
    shutil.rmtree(src)  # the workdir keeps its own copy and the end-of-document token
    ck = loading.load_checkpoint(wd)
    self.assertEqual(_data_fields(ck.config.data),
                     {"tokenizer": "hf", "tokenizer_file": os.path.join(wd, "tokenizer.json"),
                      "eos_token": EOS})
    self.assertTrue(filecmp.cmp(ck.config.data.tokenizer_file, self.tok_path, shallow=False))
    self.assertEqual((ck.tokenizer.vocab_size, ck.tokenizer.eos_id), (400, 2))
    self.assertEqual(self._ids(ck.tokenizer), self._ids(self.tok))
    self.assertEqual(ck.tokenizer.decode(ck.tokenizer.encode(SAMPLE)), SAMPLE)
    self.assertTrue(tu.tree_equal(ck.params, self.params))

  def test_relufied_run_keeps_the_tokenizer_and_resumes_without_the_directory(self):
    _, meta = checkpointing.read_meta(self.relufied, 2)
    self.assertEqual(meta["config"]["model"]["ffn_activation"], "relu")
    copy = os.path.join(self.relufied, "tokenizer.json")
    self.assertEqual(_data_fields(meta["config"]["data"]),
                     {"tokenizer": "hf", "tokenizer_file": copy, "eos_token": EOS})
    # A later run takes the tokenizer fields the workdir saved: the directory may go.
    shutil.rmtree(self.relufy_src)
    train_lib.train_and_evaluate(self._relufy_config(num_train_steps=3), self.relufied,
                                 accept_config_change=True)
    ck = loading.load_checkpoint(self.relufied)
    self.assertEqual((ck.step, ck.config.data.tokenizer_file), (3, copy))
    self.assertEqual(self._ids(ck.tokenizer), self._ids(self.tok))

  def test_export_writes_the_tokenizer_and_a_reimport_reads_it_back(self):
    self.assertIn("tokenizer.json", self.summary["files"])
    self.assertTrue(filecmp.cmp(os.path.join(self.export, "tokenizer.json"), self.tok_path,
                                shallow=False))
    read = lambda name: _read_json(os.path.join(self.export, name))
    self.assertEqual(read("tokenizer_config.json"),
                     {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                      "eos_token": EOS, "pad_token": "<pad>", "model_max_length": 32,
                      "clean_up_tokenization_spaces": False})
    self.assertEqual(read(hf_format.TWELL_TOKENIZER),
                     {"type": "hf", "file": "tokenizer.json", "eos_token": EOS,
                      "vocab_size": 400, "eos_id": 2})
    hf_cfg = read("config.json")
    self.assertEqual((hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"],
                      hf_cfg["vocab_size"], hf_cfg["hidden_act"]), (1, 2, 0, VOCAB, "relu"))
    self.assertEqual(hf_format.read_tokenizer(self.export),
                     {"tokenizer": "hf", "tokenizer_file":
                      os.path.join(self.export, "tokenizer.json"), "eos_token": EOS})
    # Without a tokenizer_config.json beside it, the eos_token of twell_tokenizer.json.
    hf = self._copy(self.export)
    os.remove(os.path.join(hf, "tokenizer_config.json"))
    wd = self.create_tempdir().full_path
    importing.import_checkpoint(hf, wd, tu.micro_config())
    back = loading.load_checkpoint(wd)
    self.assertEqual(_data_fields(back.config.data)["eos_token"], EOS)
    self.assertEqual(self._ids(back.tokenizer), self._ids(self.tok))
    self.assertTrue(tu.tree_equal(back.params,
                                loading.load_checkpoint(self.relufied, 2).params))
    # Generation encodes the prompt and decodes the completion with it.
    out = generator.generate(back.params, back.config, ["def add(a, b):"], max_new_tokens=6,
                             temperature=0.0, stop_at_eos=False, tokenizer=back.tokenizer)
    self.assertLen(out.tokens[0], 6)
    self.assertTrue(all(0 <= t < VOCAB for t in out.tokens[0]))
    self.assertEqual(out.texts[0], self.tok.decode(out.tokens[0]))

  def test_tokenizers_that_do_not_fit_are_one_line_errors(self):
    # A vocabulary the checkpoint's embedding cannot hold: nothing written.
    hf = self._copy(self.src)
    with open(os.path.join(hf, "config.json")) as f:
      cfg = json.load(f)
    cfg["vocab_size"] = 300
    with open(os.path.join(hf, "config.json"), "w") as f:
      json.dump(cfg, f)
    with hf_format.open_tensors(hf) as (get, names):
      tensors = {n: np.array(get(n)) for n in names}
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:300]
    hf_format.save_tensors(os.path.join(hf, hf_format.WEIGHTS), tensors)
    wd = self.create_tempdir().full_path
    with self.assertRaisesRegex(errors.ConfigError,
                                "tokenizer mismatch: the hf tokenizer has 400 ids, more than "
                                "the checkpoint's vocab_size 300"):
      importing.import_checkpoint(hf, wd, tu.micro_config())
    self.assertEmpty(os.listdir(wd))
    # The same for a training config.
    train_cfg = tu.micro_config(**{"data.tokenizer": "hf", "data.tokenizer_file": self.tok_path})
    with self.assertRaisesRegex(errors.ConfigError, "model.vocab_size=259 is below the "
                                "tokenizer's 400"):
      trainer_lib.Trainer(train_cfg)
    # A tokenizer.json the library cannot read, an end-of-document token it lacks.
    hf = self._copy(self.src)
    with open(os.path.join(hf, "tokenizer.json"), "w") as f:
      f.write("{}")
    with self.assertRaisesRegex(errors.ConfigError, r"config\.data\.tokenizer_file: the hf "
                                "tokenizer cannot be loaded: .*not a tokenizer.json"):
      importing.import_checkpoint(hf, self.create_tempdir().full_path, tu.micro_config())
    train_cfg.data.eos_token = "</s>"
    with self.assertRaisesRegex(errors.ConfigError, r"'</s>' is not in its vocabulary"):
      trainer_lib.Trainer(train_cfg)

  def test_which_tokenizer_a_directory_ships(self):
    hf = self._copy(self.src)
    self.assertEqual(hf_format.read_tokenizer(hf),
                     {"tokenizer": "hf", "tokenizer_file": os.path.join(hf, "tokenizer.json")})
    open(os.path.join(hf, "tokenizer.model"), "wb").close()  # Llama 2 ships both
    self.assertEqual(hf_format.read_tokenizer(hf)["tokenizer"], "sentencepiece")
    os.remove(os.path.join(hf, "tokenizer.model"))
    os.remove(os.path.join(hf, "tokenizer.json"))
    self.assertIsNone(hf_format.read_tokenizer(hf))

  @absltest.skipUnless(HAVE_TRANSFORMERS, "needs transformers and torch (the hf extra)")
  def test_transformers_reads_the_export(self):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    tok = transformers.AutoTokenizer.from_pretrained(self.export)
    ids = tok(SAMPLE, add_special_tokens=False)["input_ids"]
    self.assertEqual(ids, self._ids(self.tok))
    self.assertEqual(tok.decode(ids), SAMPLE)
    self.assertEqual((tok.eos_token_id, tok.bos_token_id, tok.pad_token_id), (2, 1, 0))
    ck = loading.load_checkpoint(self.relufied, 2)
    tokens = np.asarray([ids], np.int32)
    ours = np.asarray(ck.trainer.lm.apply(ck.params, tokens)[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(self.export)
    with torch.no_grad():
      theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=2e-4)


if __name__ == "__main__":
  absltest.main()
