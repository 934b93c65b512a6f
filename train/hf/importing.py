r"""A Hugging Face Llama checkpoint brought in as a training checkpoint (the library of
`python -m train.import_hf`, whose docstring says what a directory must hold):
`import_checkpoint(hf_dir, workdir, cfg)`."""

from __future__ import annotations

import json
import os

import jax

from train.data import pipeline as data_lib
from train.hf import init_state as hf_init
from train.state import checkpointing
from train.state import trainer as trainer_lib


def import_checkpoint(hf_dir: str, workdir: str, cfg) -> dict:
  """Writes the step-0 checkpoint of `hf_dir` into `workdir`; returns a summary."""
  if os.path.isdir(checkpointing.checkpoint_dir(workdir)) and any(
      n.isdigit() for n in os.listdir(checkpointing.checkpoint_dir(workdir))):
    raise checkpointing.CheckpointError(
        f"{workdir} already holds checkpoints; import into a new --workdir")
  cfg.init_from_hf.path = os.path.abspath(hf_dir)
  cfg = hf_init.configure(cfg, workdir)
  tr = trainer_lib.Trainer(cfg)
  state = tr.new_state(jax.random.key(cfg.seed))
  state = hf_init.initial_state(tr, state, cfg.init_from_hf.path)
  os.makedirs(workdir, exist_ok=True)
  mngr = checkpointing.make_manager(workdir, every_steps=cfg.checkpoint_every,
                                    keep=cfg.keep_checkpoints)
  try:
    checkpointing.save(mngr, 0, state,
                       {"processes": [data_lib.PackerState().to_json()
                                      for _ in range(jax.process_count())]},
                       checkpointing.meta(cfg, 0),
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
