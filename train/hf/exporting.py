r"""A training checkpoint written as a Hugging Face Llama directory (the library of
`python -m train.export_hf`, whose docstring says what it writes): `write_hf_dir`, `export`."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from train.state import checkpointing
from train.hf import format as hf_format
from train.inference import loading
from train.models import transformer as model_lib
from train import errors


def write_hf_dir(out_dir: str, params: dict, config, tokenizer, *, dtype: str | None = None,
                 overwrite: bool = False, extra: dict | None = None) -> dict:
  """Writes `params` of the training config `config` as a Hugging Face directory.

  dtype: of the written tensors (default: the parameters' own, float32 unless configured).
  extra: provenance kept under config.json's "twell_jax" key. Returns a summary.
  """
  try:
    mc = model_lib.ModelConfig.from_config(config.model)
  except (TypeError, ValueError) as e:
    raise errors.ConfigError(f"config.model: {e}") from e
  dtype = dtype or mc.param_dtype
  if dtype not in model_lib.DTYPES:
    raise errors.ConfigError(f"dtype={dtype!r} not in {list(model_lib.DTYPES)}")
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
  ck = loading.load_checkpoint(workdir, step)
  summary = write_hf_dir(out_dir, ck.params, ck.config, ck.tokenizer, dtype=dtype,
                         overwrite=overwrite,
                         extra={"source_workdir": os.path.abspath(workdir),
                                "source_step": ck.step})
  return {**summary, "step": ck.step}
