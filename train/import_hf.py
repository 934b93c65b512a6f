r"""Brings a Hugging Face Llama checkpoint in as a training checkpoint.

  python -m train.import_hf --hf_dir=DIR --workdir=W [--config=configs/tiny.py] \
      [--config.init_from_hf.activation=relu]

DIR is a Llama-architecture directory: config.json (model_type "llama", no biases, default
RoPE), model.safetensors or a sharded model.safetensors.index.json, and a tokenizer this
trainer reads (`twell_tokenizer.json` as `train.export_hf` writes it, or a SentencePiece
`tokenizer.model`). The model's shapes come from config.json, the training settings from
--config (default configs/default.py); W gets a step-0 checkpoint (the imported weights, a
fresh optimizer state, the data stream at its start) and its config.json, so that

  python -m train.evaluate --workdir=W                       # reads it
  python -m train.main --config=C --workdir=W                # resumes from it (same shapes)

The trainer does the same in one command with `--config.init_from_hf.path=DIR` (a fresh
workdir starts from the imported weights; a later run resumes from its own checkpoints
without reading DIR again): configs/relufy.py uses it to turn a SiLU-gated model's gate into
a ReLU and fine-tune it with the L1 penalty (ReLUfication).

`init_from_hf.activation`: "hf" keeps the checkpoint's hidden_act, "relu" (or "silu")
replaces it. `init_from_hf.tokenizer`: "hf" takes the directory's tokenizer (a SentencePiece
model is copied into the workdir), "config" keeps data.tokenizer as configured. Anything that
does not fit (another architecture, missing or misshapen tensors, an untied LM head, a
tokenizer the model's vocabulary cannot hold, a workdir that already holds checkpoints)
stops with a `CheckpointError` or `ConfigError` naming the problem, before anything is
written.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import sys

from absl import logging
import jax

from train import checkpointing
from train import data as data_lib
from train import hf_format
from train import train_lib

ACTIVATIONS = ("hf", "relu", "silu", "gelu")
TOKENIZERS = ("hf", "config")


def read_hf_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise checkpointing.CheckpointError(
        f"{hf_dir} is not a Hugging Face model directory: no config.json")
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise checkpointing.CheckpointError(f"{path} is not valid JSON ({e})") from None


def _saved_config(workdir: str):
  """The config a previous start of this workdir saved (config.json), or None."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def configure(cfg, workdir: str):
  """`cfg` with the model's shapes and the tokenizer of cfg.init_from_hf.path (in place).

  A workdir started from that directory before keeps the shapes and tokenizer it saved then
  (a resumed run does not need the directory any more).
  """
  hf = cfg.init_from_hf
  if hf.activation not in ACTIVATIONS:
    raise train_lib.ConfigError(f"init_from_hf.activation={hf.activation!r} not in "
                                f"{ACTIVATIONS}")
  if hf.tokenizer not in TOKENIZERS:
    raise train_lib.ConfigError(f"init_from_hf.tokenizer={hf.tokenizer!r} not in {TOKENIZERS}")
  hf.path = os.path.abspath(hf.path)
  saved = _saved_config(workdir)
  if saved is not None and (saved.get("init_from_hf") or {}).get("path") == hf.path:
    cfg.model.update({k: saved["model"][k] for k in (
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta",
        "norm_eps", "ffn_gated", "ffn_activation")})
    cfg.data.update({k: saved["data"][k] for k in ("tokenizer", "spm_model")})
    return cfg
  where = os.path.join(hf.path, "config.json")
  fields = hf_format.model_fields(read_hf_config(hf.path), where)
  if hf.activation != "hf":
    fields["ffn_activation"] = hf.activation
  cfg.model.update(fields)
  if hf.tokenizer == "hf":
    found = hf_format.read_tokenizer(hf.path)
    if found is None:
      raise checkpointing.CheckpointError(
          f"{hf.path} ships no tokenizer this trainer reads ({hf_format.TWELL_TOKENIZER} or "
          "a SentencePiece tokenizer.model); give one with --config.init_from_hf.tokenizer="
          "config and --config.data.tokenizer / --config.data.spm_model")
    cfg.data.tokenizer, path = found
    if path is not None:
      cfg.data.spm_model = path
  tokenizer = data_lib.make_tokenizer(cfg.data)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise train_lib.ConfigError(
        f"tokenizer mismatch: the {cfg.data.tokenizer} tokenizer has {tokenizer.vocab_size} "
        f"ids, more than the checkpoint's vocab_size {cfg.model.vocab_size} ({where})")
  if hf.tokenizer == "hf" and cfg.data.tokenizer == "sentencepiece":
    # The workdir keeps its own copy: it stays usable when DIR moves or goes.
    os.makedirs(workdir, exist_ok=True)
    dst = os.path.join(os.path.abspath(workdir), "tokenizer.model")
    if not (os.path.isfile(dst) and filecmp.cmp(cfg.data.spm_model, dst, shallow=False)):
      shutil.copyfile(cfg.data.spm_model, dst)
    cfg.data.spm_model = dst
  return cfg


def initial_state(trainer: train_lib.Trainer, state: dict, hf_dir: str) -> dict:
  """A fresh train state whose params are the checkpoint's (optimizer state re-initialised)."""
  with hf_format.open_tensors(hf_dir) as (get, names):
    params = hf_format.from_hf_tensors(get, names, trainer.model_cfg, where=hf_dir)
  if jax.tree.structure(params) != jax.tree.structure(state["params"]):
    raise checkpointing.CheckpointError(
        f"{hf_dir}: the imported parameters do not have the model's structure")
  params = jax.device_put(params, trainer.state_sharding["params"])
  opt_state = jax.jit(trainer.tx.init,
                      out_shardings=trainer.state_sharding["opt_state"])(params)
  logging.info("Initialised from the Hugging Face checkpoint %s", hf_dir)
  return {**state, "params": params, "opt_state": opt_state}


def import_checkpoint(hf_dir: str, workdir: str, cfg) -> dict:
  """Writes the step-0 checkpoint of `hf_dir` into `workdir`; returns a summary."""
  if os.path.isdir(checkpointing.checkpoint_dir(workdir)) and any(
      n.isdigit() for n in os.listdir(checkpointing.checkpoint_dir(workdir))):
    raise checkpointing.CheckpointError(
        f"{workdir} already holds checkpoints; import into a new --workdir")
  cfg.init_from_hf.path = os.path.abspath(hf_dir)
  cfg = configure(cfg, workdir)
  tr = train_lib.Trainer(cfg)
  state = tr.new_state(jax.random.key(cfg.seed))
  state = initial_state(tr, state, cfg.init_from_hf.path)
  os.makedirs(workdir, exist_ok=True)
  mngr = checkpointing.make_manager(workdir, every_steps=cfg.checkpoint_every,
                                    keep=cfg.keep_checkpoints)
  try:
    checkpointing.save(mngr, 0, state,
                       {"processes": [data_lib.PackerState().to_json()
                                      for _ in range(jax.process_count())]},
                       train_lib._meta(cfg, 0),  # pylint: disable=protected-access
                       force=True)
    mngr.wait_until_finished()
  finally:
    mngr.close()
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=1)
  mc = tr.model_cfg
  return {"workdir": os.path.abspath(workdir), "hf_dir": cfg.init_from_hf.path, "step": 0,
          "model": {k: getattr(mc, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads",
                                                "n_kv_heads", "d_ff", "ffn_activation")},
          "tokenizer": cfg.data.tokenizer}


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("hf_dir", None, "The Hugging Face Llama directory to import.")
  flags.DEFINE_string("workdir", None, "The new training workdir.")
  config_flags.DEFINE_config_file("config", None, "Training config (default: "
                                  "configs/default.py); model shapes come from --hf_dir.",
                                  lock_config=True)
  flags.mark_flags_as_required(["hf_dir", "workdir"])


def main(argv):
  from absl import app  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  from train import metrics  # pylint: disable=import-outside-toplevel
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  metrics.quiet_library_logs()
  f = flags.FLAGS
  cfg = f.config
  if cfg is None:
    from configs import default  # pylint: disable=import-outside-toplevel
    cfg = default.get_config()
  try:
    summary = import_checkpoint(f.hf_dir, f.workdir, cfg)
  except (checkpointing.CheckpointError, train_lib.ConfigError) as e:
    logging.error("%s", e)
    sys.exit(f"error: {e}")
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  from absl import app as _app  # pylint: disable=g-import-not-at-top
  _define_flags()
  jax.config.config_with_absl()
  _app.run(main)
