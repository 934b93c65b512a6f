r"""Writes a checkpoint as a Hugging Face Llama directory.

  python -m train.export_hf --workdir=W --out=DIR [--step=N] [--dtype=bfloat16]

DIR gets config.json (model_type "llama", hidden_act "relu" for the sparse model, tied
embeddings), generation_config.json, model.safetensors with the standard tensor names
(`train.hf_format`) and the tokenizer files. `transformers.AutoModelForCausalLM
.from_pretrained(DIR)` loads it and computes the same logits (tested where transformers and
torch are installed); `python -m train.import_hf --hf_dir=DIR` brings it back.

The directory is written beside DIR first and moved into place when complete, and an existing
non-empty DIR is left alone unless --overwrite is given, so an interrupted export never leaves
a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np

from train import checkpointing
from train import hf_format
from train import inference
from train import model as model_lib
from train import train_lib


def write_hf_dir(out_dir: str, params: dict, config, tokenizer, *, dtype: str | None = None,
                 overwrite: bool = False, extra: dict | None = None) -> dict:
  """Writes `params` of the training config `config` as a Hugging Face directory.

  dtype: of the written tensors (default: the parameters' own, float32 unless configured).
  extra: provenance kept under config.json's "twell_jax" key. Returns a summary.
  """
  try:
    mc = model_lib.ModelConfig.from_config(config.model)
  except (TypeError, ValueError) as e:
    raise train_lib.ConfigError(f"config.model: {e}") from e
  dtype = dtype or mc.param_dtype
  if dtype not in model_lib.DTYPES:
    raise train_lib.ConfigError(f"dtype={dtype!r} not in {list(model_lib.DTYPES)}")
  out_dir = os.path.abspath(out_dir)
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise checkpointing.CheckpointError(
        f"{out_dir} exists and is not empty; pass --overwrite to replace it")
  context = int(config.data.seq_len)
  ids = hf_format.special_ids(config.data, tokenizer)
  hf_cfg = hf_format.hf_config(mc, context=context, special_ids=ids, dtype=dtype,
                               extra={"l1_coeff": float(config.l1_coeff), **(extra or {})})
  tensors = hf_format.to_hf_tensors(params, mc, np.dtype(model_lib.DTYPES[dtype]))
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
  try:
    hf_format.save_tensors(os.path.join(tmp, hf_format.WEIGHTS), tensors)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=1)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
      json.dump({"_from_model_config": True, **{f"{k}_token_id": v for k, v in ids.items()
                                                if v is not None}}, f, indent=1)
    files = hf_format.write_tokenizer(tmp, config.data, tokenizer, context)
    if os.path.exists(out_dir):
      shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return {"out": out_dir, "dtype": dtype, "tensors": len(tensors),
          "hidden_act": hf_cfg["hidden_act"],
          "files": ["config.json", "generation_config.json", hf_format.WEIGHTS, *files]}


def export(workdir: str, out_dir: str, *, step: int | None = None, dtype: str | None = None,
           overwrite: bool = False) -> dict:
  """Exports `step` (default: the latest) of `workdir` to `out_dir` (`write_hf_dir`)."""
  ck = inference.load_checkpoint(workdir, step)
  summary = write_hf_dir(out_dir, ck.params, ck.config, ck.tokenizer, dtype=dtype,
                         overwrite=overwrite,
                         extra={"source_workdir": os.path.abspath(workdir),
                                "source_step": ck.step})
  return {**summary, "step": ck.step}


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
  flags.DEFINE_string("out", None, "The Hugging Face directory to write.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_enum("dtype", None, list(model_lib.DTYPES), "Tensor dtype (default: the parameters').")
  flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out.")
  flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  from absl import app  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  from absl import logging  # pylint: disable=import-outside-toplevel
  from train import metrics  # pylint: disable=import-outside-toplevel
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  metrics.quiet_library_logs()
  f = flags.FLAGS
  try:
    summary = export(f.workdir, f.out, step=f.step, dtype=f.dtype, overwrite=f.overwrite)
  except (checkpointing.CheckpointError, train_lib.ConfigError) as e:
    logging.error("%s", e)
    sys.exit(f"error: {e}")
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  from absl import app as _app  # pylint: disable=g-import-not-at-top
  _define_flags()
  _app.run(main)
