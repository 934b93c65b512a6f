"""Tests for the Hugging Face Llama export and import: the directory's layout, the round
trip (same eval loss, both layer layouts, the trainer resumes), bad directories, and, where
transformers and torch are installed, the exported model's logits against ours."""

import importlib.util
import json
import os
import shutil
import sys

import jax
import numpy as np
from absl.testing import absltest

import train_test_util as tu
from train.state import checkpointing
from train.hf import exporting
from train.hf import format as hf_format
from train.hf import importing
from train.inference import loading
from train.training import loop as train_lib
from train.state import trainer as trainer_lib
from train import errors

HAVE_TRANSFORMERS = all(importlib.util.find_spec(m) is not None
                        for m in ("transformers", "torch"))


class HFInteropTest(tu.FastCompile, absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.workdir = tu.trained_workdir("relu")
    cls.hf_dir = os.path.join(absltest.get_default_test_tmpdir(), "hf_interop_export")
    shutil.rmtree(cls.hf_dir, ignore_errors=True)
    cls.summary = exporting.export(cls.workdir, cls.hf_dir)
    cls.loss = loading.evaluate_checkpoint(cls.workdir)["loss"]

  def _copy_of_export(self):
    path = os.path.join(self.create_tempdir().full_path, "hf")
    shutil.copytree(self.hf_dir, path)
    return path

  def _edit_config(self, hf_dir, **changes):
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
      cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
      json.dump(cfg, f)

  def test_export_is_a_llama_directory(self):
    self.assertEqual(self.summary["step"], 60)
    with open(os.path.join(self.hf_dir, "config.json")) as f:
      cfg = json.load(f)
    self.assertEqual((cfg["model_type"], cfg["hidden_act"], cfg["tie_word_embeddings"]),
                     ("llama", "relu", True))
    self.assertEqual((cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                      cfg["num_attention_heads"], cfg["num_key_value_heads"]),
                     (32, 256, 2, 2, 1))
    with hf_format.open_tensors(self.hf_dir) as (get, names):
      self.assertEqual(get("model.layers.0.mlp.gate_proj.weight").shape, (256, 32))
      self.assertEqual(get("model.layers.1.self_attn.k_proj.weight").shape, (16, 32))
      self.assertNotIn("lm_head.weight", names)
      self.assertLen(names, 2 + 9 * 2)
    for name in ("tokenizer.json", "tokenizer_config.json", "twell_tokenizer.json",
                 "generation_config.json"):
      self.assertTrue(os.path.isfile(os.path.join(self.hf_dir, name)), name)

  def test_round_trip_gives_the_same_eval_loss(self):
    for scan in (False, True):
      wd = self.create_tempdir().full_path
      importing.import_checkpoint(self.hf_dir, wd, tu.micro_config(
          **{"model.scan_layers": scan}))
      loss = loading.evaluate_checkpoint(wd)["loss"]
      if scan:  # the same weights through lax.scan: float32 rounding may differ
        self.assertAlmostEqual(loss, self.loss, places=5)
      else:
        self.assertEqual(loss, self.loss)
    # Loop layout: the parameters themselves come back bit for bit.
    ours = loading.load_checkpoint(self.workdir).params
    back = loading.load_checkpoint(self._imported()).params
    self.assertTrue(tu.tree_equal(ours, back))

  def _imported(self):
    wd = self.create_tempdir().full_path
    importing.import_checkpoint(self.hf_dir, wd, tu.micro_config())
    return wd

  def test_trainer_resumes_from_an_import_and_the_cli_commands_run(self):
    wd = os.path.join(self.create_tempdir().full_path, "imported")
    run = tu.run([sys.executable, "-m", "train.import_hf", f"--hf_dir={self.hf_dir}",
                  f"--workdir={wd}", "--config=configs/tiny.py",
                  f"--config.data.data_dir={tu.offline_data_dir()}",
                  # The data stream the training below runs (the workdir keeps its config).
                  "--config.batch_size=8", "--config.data.seq_len=32"],
                 JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    self.assertEqual(json.loads(run.stdout)["model"]["ffn_activation"], "relu")
    cfg = tu.micro_config(num_train_steps=2)
    # Same shapes and data stream; the schedule differs from the import's config.
    train_lib.train_and_evaluate(cfg, wd, accept_config_change=True)
    self.assertEqual(checkpointing.read_meta(wd)[0], 2)
    out = os.path.join(self.create_tempdir().full_path, "again")
    run = tu.run([sys.executable, "-m", "train.export_hf", f"--workdir={wd}", f"--out={out}",
                  "--dtype=bfloat16"], JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    self.assertEqual(json.loads(run.stdout)["step"], 2)
    with hf_format.open_tensors(out) as (get, _):
      self.assertEqual(str(get("model.norm.weight").dtype), "bfloat16")

  def test_bad_directories_are_clear_errors(self):
    cfg = tu.micro_config
    cases = []
    hf = self._copy_of_export()
    self._edit_config(hf, model_type="mistral")
    cases.append((hf, "model_type 'mistral' is not supported"))
    hf = self._copy_of_export()
    self._edit_config(hf, intermediate_size=128)
    cases.append((hf, r"gate_proj.weight has shape \(256, 32\), but config.json implies "
                      r"\(128, 32\)"))
    hf = self._copy_of_export()
    self._edit_config(hf, attention_bias=True)
    cases.append((hf, "no biases"))
    hf = self._copy_of_export()
    for name in ("twell_tokenizer.json", "tokenizer.json"):
      os.remove(os.path.join(hf, name))
    cases.append((hf, "ships no tokenizer"))
    hf = self._copy_of_export()
    with hf_format.open_tensors(hf) as (get, names):
      tensors = {n: np.array(get(n)) for n in names}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    hf_format.save_tensors(os.path.join(hf, hf_format.WEIGHTS), tensors)
    cases.append((hf, "untied head"))
    cases.append((self.create_tempdir().full_path, "no config.json"))
    for hf, message in cases:
      wd = self.create_tempdir().full_path
      with self.assertRaisesRegex(checkpointing.CheckpointError, message):
        importing.import_checkpoint(hf, wd, cfg())
      self.assertEmpty(os.listdir(wd), "a failed import left files behind")
    # A tokenizer whose ids the checkpoint's vocabulary cannot hold.
    hf = self._copy_of_export()
    self._edit_config(hf, vocab_size=200)
    with hf_format.open_tensors(hf) as (get, names):
      tensors = {n: np.array(get(n)) for n in names}
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:200]
    hf_format.save_tensors(os.path.join(hf, hf_format.WEIGHTS), tensors)
    with self.assertRaisesRegex(errors.ConfigError, "tokenizer mismatch"):
      importing.import_checkpoint(hf, self.create_tempdir().full_path, cfg())
    # Nothing is overwritten: a workdir with checkpoints, a non-empty export directory.
    with self.assertRaisesRegex(checkpointing.CheckpointError, "already holds checkpoints"):
      importing.import_checkpoint(self.hf_dir, self.workdir, cfg())
    with self.assertRaisesRegex(checkpointing.CheckpointError, "not empty"):
      exporting.export(self.workdir, self.hf_dir)
    # A Hugging Face directory where a workdir is expected; checkpoints of another program.
    with self.assertRaisesRegex(checkpointing.CheckpointError, "train.import_hf"):
      loading.load_checkpoint(self.hf_dir)
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    foreign = self.create_tempdir().full_path
    mngr = ocp.CheckpointManager(checkpointing.checkpoint_dir(foreign), item_names=("params",))
    mngr.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.ones(3)})))
    mngr.wait_until_finished()
    mngr.close()
    with self.assertRaisesRegex(checkpointing.CheckpointError, "written by another program"):
      loading.load_checkpoint(foreign)

  def test_sentencepiece_tokenizer_goes_out_and_comes_back(self):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    from train.models import transformer as model_lib  # pylint: disable=g-import-not-at-top
    from train.corpus import text_corpus  # pylint: disable=g-import-not-at-top
    texts = [t for _, t in list(text_corpus.iter_documents("train"))[:300]]
    spm_path = os.path.join(self.create_tempdir().full_path, "tiny.model")
    with open(spm_path, "wb") as f:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(texts), model_writer=f, vocab_size=300, model_type="bpe",
          pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    cfg = tu.micro_config(**{"model.vocab_size": 320, "data.tokenizer": "sentencepiece",
                             "data.spm_model": spm_path})
    lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
    params = lm.init_params(jax.random.key(0))
    hf = os.path.join(self.create_tempdir().full_path, "spm_hf")
    exporting.write_hf_dir(hf, params, cfg, trainer_lib.Trainer(cfg).tokenizer)
    with open(os.path.join(hf, "tokenizer_config.json")) as f:
      self.assertEqual(json.load(f)["tokenizer_class"], "LlamaTokenizer")
    with open(os.path.join(hf, "config.json")) as f:
      self.assertEqual(json.load(f)["eos_token_id"], 1)
    wd = self.create_tempdir().full_path
    self.assertEqual(importing.import_checkpoint(hf, wd, tu.micro_config())["tokenizer"],
                     "sentencepiece")
    back = loading.load_checkpoint(wd)
    self.assertEqual(back.config.data.spm_model, os.path.join(wd, "tokenizer.model"))
    self.assertEqual(back.tokenizer.vocab_size, 300)
    self.assertTrue(tu.tree_equal(params, back.params))
    # A vocabulary smaller than the tokenizer's: a clear error, nothing written.
    self._edit_config(hf, vocab_size=256)
    wd = self.create_tempdir().full_path
    with self.assertRaisesRegex(errors.ConfigError, "tokenizer mismatch"):
      importing.import_checkpoint(hf, wd, tu.micro_config())
    self.assertEmpty(os.listdir(wd))

  @absltest.skipUnless(HAVE_TRANSFORMERS, "needs transformers and torch (the hf extra)")
  def test_transformers_logits_match_ours(self):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    from train.models import transformer as model_lib  # pylint: disable=g-import-not-at-top
    # A random model with non-default RoPE base, GQA and the scan layout, besides the
    # trained export.
    cfg = tu.micro_config(**{"model.rope_theta": 5e5, "model.n_heads": 4,
                             "model.n_kv_heads": 2, "model.scan_layers": True})
    lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
    params = jax.tree.map(lambda a: a * 3 if a.ndim >= 2 else a,
                          lm.init_params(jax.random.key(4)))
    random_dir = os.path.join(self.create_tempdir().full_path, "random")
    exporting.write_hf_dir(random_dir, params, cfg, trainer_lib.Trainer(cfg).tokenizer)
    trained = loading.load_checkpoint(self.workdir)
    tokens = np.random.default_rng(0).integers(3, 259, (2, 24)).astype(np.int32)
    for hf_dir, lm, params in ((self.hf_dir, trained.trainer.lm, trained.params),
                               (random_dir, lm, params)):
      ours = np.asarray(lm.apply(params, tokens)[0])
      model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
      with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
      np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=2e-4)
    tok = transformers.AutoTokenizer.from_pretrained(self.hf_dir)
    text = "héllo ✓\n\tdef f():"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    self.assertEqual(ids, [int(i) for i in trained.tokenizer.encode(text)])
    self.assertEqual(tok.decode(ids), text)


if __name__ == "__main__":
  absltest.main()
