"""A trained checkpoint opened for inference: its config, model, tokenizer and parameters.

`load_checkpoint(workdir, step)` is what `train.evaluate`, `train.generate`, `train.export_hf`
and `train.report` start from: it reads the config saved with the checkpoint (so a workdir is
self-describing), rebuilds the model and the tokenizer from it and restores only the
parameters, read-only. Problems the user must fix come out as `CheckpointError` (no
checkpoint, not one of ours, unreadable) or `ConfigError` (its config cannot be rebuilt here,
e.g. the SentencePiece model or tokenizer.json it names is gone or unreadable), which the
CLIs print without a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections

from train.state import checkpointing
from train.models import transformer as model_lib
from train.runtime import mesh as mesh_lib
from train.state import trainer as trainer_lib


@dataclasses.dataclass
class Checkpoint:
  """One restored checkpoint (parameters laid out on the run's mesh where it fits the
  devices here, else replicated on them)."""
  step: int
  config: Any                      # the training ConfigDict saved with it
  trainer: trainer_lib.Trainer       # model, tokenizer and eval data built from `config`
  params: dict

  @property
  def model_cfg(self) -> model_lib.ModelConfig:
    return self.trainer.model_cfg

  @property
  def tokenizer(self):
    return self.trainer.tokenizer


def _hint_for(workdir: str) -> str:
  """What a workdir that holds no usable checkpoint holds instead, if it can be told: a
  Hugging Face directory, or checkpoints another program wrote."""
  root = checkpointing.checkpoint_dir(workdir)
  steps = sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []
  if steps:
    items = sorted(os.listdir(os.path.join(root, str(steps[-1]))))
    if not {"state", "meta"} <= set(items):
      return (f" (step {steps[-1]} holds {items}, not the state / data / meta items of a "
              "twell-jax training checkpoint: written by another program?)")
  path = os.path.join(workdir, "config.json")
  if os.path.isfile(path):
    try:
      with open(path) as f:
        if "model_type" in json.load(f):
          return (f" ({workdir} looks like a Hugging Face model directory: bring it in with "
                  f"python -m train.import_hf --hf_dir={workdir} --workdir=NEW_WORKDIR)")
    except (OSError, ValueError):
      pass
  return ""


def config_of(meta: dict, workdir: str):
  """The training ConfigDict saved in a checkpoint's meta item."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  config = meta.get("config") if isinstance(meta, dict) else None
  if not isinstance(config, dict) or "model" not in config or "data" not in config:
    raise checkpointing.CheckpointError(
        f"the checkpoint in {checkpointing.checkpoint_dir(workdir)} carries no twell-jax "
        "training config: not a checkpoint written by train.main or train.import_hf")
  return ml_collections.ConfigDict(config)


def load_checkpoint(workdir: str, step: int | None = None, *,
                    data_dir: str | None = None) -> Checkpoint:
  """Restores the parameters of `step` (default: the latest) of `workdir`, read-only.

  Raises:
    CheckpointError: no checkpoint there, not one of ours, or unreadable.
    ConfigError: its config does not build here (bad model fields, tokenizer file missing).
  """
  try:
    step, meta = checkpointing.read_meta(workdir, step)
  except checkpointing.CheckpointError as e:
    raise checkpointing.CheckpointError(f"{e}{_hint_for(workdir)}") from None
  cfg = config_of(meta, workdir)
  if data_dir:
    cfg.data.data_dir = data_dir
  try:
    mesh_lib.mesh_shape(cfg.get("mesh"), jax.device_count())
  except mesh_lib.MeshError:  # the run's mesh does not fit the devices here: all of them
    cfg.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1))
  trainer = trainer_lib.Trainer(cfg)  # ConfigError names a tokenizer file it cannot load
  abstract = trainer.abstract_state()["params"]
  params = checkpointing.restore_params(workdir, abstract, step)
  return Checkpoint(step=step, config=cfg, trainer=trainer, params=params)


def inference_params(params: dict, model_cfg: model_lib.ModelConfig) -> dict:
  """The parameters as inference reads them: block weights stacked [L, ...] (the scan
  layout, whichever layout trained them) and matrices cast to the compute dtype once, so
  that no step re-reads f32 weights to cast them; the RMSNorm scales stay as they are (the
  norms compute in f32).

  On one device, the first local one: prefill and decode run there. Parameters restored
  onto the run's mesh are gathered (split over fsdp, XLA's partitioner gave the cuDNN
  attention differently split queries, keys and values, which it refuses; replicated, every
  device would repeat the same work).
  """
  dt = model_lib.DTYPES[model_cfg.dtype]
  params = jax.device_put(params, jax.local_devices()[0])
  params = {**params, "blocks": model_lib.stacked_blocks(params, model_cfg.n_layers)}

  def cast(path, a):
    is_norm_scale = getattr(path[-1], "key", None) == "scale"
    return a if is_norm_scale else a.astype(dt)

  return jax.tree_util.tree_map_with_path(cast, params)


def evaluate_checkpoint(workdir: str, step: int | None = None,
                        eval_batches: int | None = None,
                        data_dir: str | None = None) -> dict:
  """Held-out cross-entropy, perplexity and per-layer sparsity of a checkpoint's eval split
  (`python -m train.evaluate`): the JSON dict it prints."""
  ck = load_checkpoint(workdir, step, data_dir=data_dir)
  if eval_batches:
    ck.config.eval_batches = eval_batches
  result = ck.trainer.evaluate(ck.params, ck.trainer.eval_batches())
  return {"step": ck.step, "workdir": os.path.abspath(workdir),
          "eval_split": ck.config.data.eval_split, **result}
