"""Starting a training run from a Hugging Face Llama checkpoint (`config.init_from_hf`).

`configure` takes the model's shapes and tokenizer from the directory (a workdir started from
it before keeps those it saved); `initial_state` puts the directory's weights into a fresh
train state. The trainer calls both for `--config.init_from_hf.path=DIR`; `train.import_hf`
writes the same state as a step-0 checkpoint. See `train.import_hf` for what DIR must hold.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil

from absl import logging
import jax

from train import errors
from train.config import checks as config_checks
from train.hf import format as hf_format
from train.data import tokenizer as tokenizer_lib

ACTIVATIONS = ("hf", "relu", "silu", "gelu")
TOKENIZERS = ("hf", "config")
# The data fields that name a tokenizer (what a resumed workdir keeps).
_TOKENIZER_FIELDS = ("tokenizer", "spm_model", "tokenizer_file", "eos_token")
# data.tokenizer -> (the field naming its file, the name of the workdir's copy).
_WORKDIR_COPIES = {"sentencepiece": ("spm_model", "tokenizer.model"),
                   "hf": ("tokenizer_file", "tokenizer.json")}


def read_hf_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise errors.CheckpointError(
        f"{hf_dir} is not a Hugging Face model directory: no config.json")
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise errors.CheckpointError(f"{path} is not valid JSON ({e})") from None


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
    raise config_checks.ConfigError(f"init_from_hf.activation={hf.activation!r} not in "
                                f"{ACTIVATIONS}")
  if hf.tokenizer not in TOKENIZERS:
    raise config_checks.ConfigError(f"init_from_hf.tokenizer={hf.tokenizer!r} not in {TOKENIZERS}")
  hf.path = os.path.abspath(hf.path)
  saved = _saved_config(workdir)
  if saved is not None and (saved.get("init_from_hf") or {}).get("path") == hf.path:
    cfg.model.update({k: saved["model"][k] for k in (
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta",
        "norm_eps", "ffn_gated", "ffn_activation")})
    cfg.data.update({k: saved["data"].get(k) for k in _TOKENIZER_FIELDS})
    return cfg
  where = os.path.join(hf.path, "config.json")
  fields = hf_format.model_fields(read_hf_config(hf.path), where)
  if hf.activation != "hf":
    fields["ffn_activation"] = hf.activation
  cfg.model.update(fields)
  if hf.tokenizer == "hf":
    found = hf_format.read_tokenizer(hf.path)
    if found is None:
      raise errors.CheckpointError(
          f"{hf.path} ships no tokenizer this trainer reads ({hf_format.TWELL_TOKENIZER}, "
          "a SentencePiece tokenizer.model or a tokenizer.json); give one with "
          "--config.init_from_hf.tokenizer=config and --config.data.tokenizer / "
          "--config.data.spm_model / --config.data.tokenizer_file")
    cfg.data.update(found)
  tokenizer = tokenizer_lib.make_tokenizer(cfg.data)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise config_checks.ConfigError(
        f"tokenizer mismatch: the {cfg.data.tokenizer} tokenizer has {tokenizer.vocab_size} "
        f"ids, more than the checkpoint's vocab_size {cfg.model.vocab_size} ({where})")
  if hf.tokenizer == "hf" and cfg.data.tokenizer in _WORKDIR_COPIES:
    # The workdir keeps its own copy: it stays usable when DIR moves or goes.
    field, name = _WORKDIR_COPIES[cfg.data.tokenizer]
    os.makedirs(workdir, exist_ok=True)
    dst = os.path.join(os.path.abspath(workdir), name)
    if not (os.path.isfile(dst) and filecmp.cmp(cfg.data[field], dst, shallow=False)):
      shutil.copyfile(cfg.data[field], dst)
    cfg.data[field] = dst
    if cfg.data.tokenizer == "hf":  # the copy has no tokenizer_config.json beside it
      cfg.data.eos_token = tokenizer.eos_token
  return cfg


def initial_state(trainer, state: dict, hf_dir: str) -> dict:
  """A fresh train state whose params are the checkpoint's (optimizer state re-initialised);
  `trainer` a `train.state.trainer.Trainer`."""
  with hf_format.open_tensors(hf_dir) as (get, names):
    params = hf_format.from_hf_tensors(get, names, trainer.model_cfg, where=hf_dir)
  if jax.tree.structure(params) != jax.tree.structure(state["params"]):
    raise errors.CheckpointError(
        f"{hf_dir}: the imported parameters do not have the model's structure")
  params = jax.device_put(params, trainer.state_sharding["params"])
  opt_state = jax.jit(trainer.tx.init,
                      out_shardings=trainer.state_sharding["opt_state"])(params)
  logging.info("Initialised from the Hugging Face checkpoint %s", hf_dir)
  return {**state, "params": params, "opt_state": opt_state}
