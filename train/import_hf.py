r"""Brings a Hugging Face Llama checkpoint in as a training checkpoint.

  python -m train.import_hf --hf_dir=DIR --workdir=W [--config=configs/tiny.py] \
      [--config.init_from_hf.activation=relu]

DIR is a Llama-architecture directory: config.json (model_type "llama", no biases, default
RoPE), model.safetensors or a sharded model.safetensors.index.json, and a tokenizer this
trainer reads (`twell_tokenizer.json` as `train.export_hf` writes it, a SentencePiece
`tokenizer.model`, or a Hugging Face `tokenizer.json`, whose end-of-document token is
--config.data.eos_token, else the `eos_token` of its `tokenizer_config.json`). The model's
shapes come from config.json, the training settings from --config (default
configs/default.py); W gets a step-0 checkpoint (the imported weights, a fresh optimizer
state, the data stream at its start) and its config.json, so that

  python -m train.evaluate --workdir=W                       # reads it
  python -m train.main --config=C --workdir=W                # resumes from it (same shapes)

The trainer does the same in one command with `--config.init_from_hf.path=DIR` (a fresh
workdir starts from the imported weights; a later run resumes from its own checkpoints
without reading DIR again): configs/relufy.py uses it to turn a SiLU-gated model's gate into
a ReLU and fine-tune it with the L1 penalty (ReLUfication).

`init_from_hf.activation`: "hf" keeps the checkpoint's hidden_act, "relu" (or "silu")
replaces it. `init_from_hf.tokenizer`: "hf" takes the directory's tokenizer (a SentencePiece
model or a tokenizer.json is copied into the workdir, and data.eos_token set), "config"
keeps data.tokenizer as configured. Anything that does not fit (another architecture,
missing or misshapen tensors, an untied LM head, a tokenizer the model's vocabulary cannot
hold, a workdir that already holds checkpoints) stops with a `CheckpointError` or
`ConfigError` naming the problem, before anything is written.
"""

import json

from train import cli
from train.hf import importing


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("hf_dir", None, "The Hugging Face Llama directory to import.")
  flags.DEFINE_string("workdir", None, "The new training workdir.")
  config_flags.DEFINE_config_file("config", None, "Training config (default: "
                                  "configs/default.py); model shapes come from --hf_dir.",
                                  lock_config=True)
  flags.mark_flags_as_required(["hf_dir", "workdir"])


def main():
  from absl import flags  # pylint: disable=import-outside-toplevel
  f = flags.FLAGS
  cfg = f.config
  if cfg is None:
    from configs import default  # pylint: disable=import-outside-toplevel
    cfg = default.get_config()
  print(json.dumps(importing.import_checkpoint(f.hf_dir, f.workdir, cfg), indent=1))


if __name__ == "__main__":
  cli.run(main, _define_flags)
