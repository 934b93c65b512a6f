r"""Writes a checkpoint as a Hugging Face Llama directory.

  python -m train.export_hf --workdir=W --out=DIR [--step=N] [--dtype=bfloat16]

DIR gets config.json (model_type "llama", hidden_act "relu" for the sparse model, tied
embeddings), generation_config.json, model.safetensors with the standard tensor names
(`train.hf.format`) and the tokenizer files. `transformers.AutoModelForCausalLM
.from_pretrained(DIR)` loads it and computes the same logits (tested where transformers and
torch are installed); `python -m train.import_hf --hf_dir=DIR` brings it back.

The directory is written beside DIR first and moved into place when complete, and an existing
non-empty DIR is left alone unless --overwrite is given, so an interrupted export never leaves
a half-written model behind.
"""

import json

from train import cli
from train.hf import exporting
from train.models import transformer


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
  flags.DEFINE_string("out", None, "The Hugging Face directory to write.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_enum("dtype", None, list(transformer.DTYPES), "Tensor dtype (default: the parameters').")
  flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out.")
  flags.mark_flags_as_required(["workdir", "out"])


def main():
  from absl import flags  # pylint: disable=import-outside-toplevel
  f = flags.FLAGS
  summary = exporting.export(f.workdir, f.out, step=f.step, dtype=f.dtype, overwrite=f.overwrite)
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  cli.run(main, _define_flags)
