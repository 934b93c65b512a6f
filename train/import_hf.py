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

import json
import os
import sys

from absl import logging
import jax

from train import checkpointing
from train import data as data_lib
from train import hf_format
from train import hf_init
from train import train_lib

def import_checkpoint(hf_dir: str, workdir: str, cfg) -> dict:
  """Writes the step-0 checkpoint of `hf_dir` into `workdir`; returns a summary."""
  if os.path.isdir(checkpointing.checkpoint_dir(workdir)) and any(
      n.isdigit() for n in os.listdir(checkpointing.checkpoint_dir(workdir))):
    raise checkpointing.CheckpointError(
        f"{workdir} already holds checkpoints; import into a new --workdir")
  cfg.init_from_hf.path = os.path.abspath(hf_dir)
  cfg = hf_init.configure(cfg, workdir)
  tr = train_lib.Trainer(cfg)
  state = tr.new_state(jax.random.key(cfg.seed))
  state = hf_init.initial_state(tr, state, cfg.init_from_hf.path)
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
