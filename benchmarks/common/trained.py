"""Models trained in-process to a chosen FFN activity, cached on the machine's disk.

Real L1-trained activations are the benchmarks' target, and no checkpoint can be downloaded,
so the benchmarks train the project's own model (`train/`) on the offline corpus with the
byte tokenizer until sparsity emerges:

  * "paper": the paper-like level (about 25-40 active features per token on average), from
    scratch with L1 `PAPER_L1` for `steps` steps;
  * "extreme": under 10 per token, continuing from the paper level's weights with the
    stronger `EXTREME_L1` (fresh optimizer state).

The dense ReLU FFN trains while activity is high (it is the fastest there, and the weights do
not depend on the implementation). Parameters are cached as `<cache_dir>/<name>.npz`, so a
second call on a machine that is still warm skips the training. `config_for` gives the
model + data config of a shape (`paper_0p5b`, `tiny` for CPU tests).
"""

from __future__ import annotations

import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

PAPER_L1 = 3e-5
EXTREME_L1 = 3e-4
DEFAULT_CACHE = "/tmp/twell_trained"


# `tokenizer="python32k"`: the Python-source corpus with its 32k SentencePiece tokenizer
# (`train.corpus.build_tokenizer`, trained offline on first use and cached here).
PYTHON_TOKENIZER = "~/.cache/twell_jax/tokenizers/python_source_site_32k"


# The paper shapes' settings for short runs on one GPU (the configs' own are for 50k-step
# runs of 0.5M-token batches): 8 x 2048 tokens a step, no remat, a higher peak rate.
SHORT_RUN = {"batch_size": 8, "grad_accum_steps": 1, "model.remat": False,
             "learning_rate": 1e-3, "warmup_steps": 100}


def short_run_flags(warmup_steps: int) -> list[str]:
  """`SHORT_RUN` as `train.main` flags, with the warm-up of the caller's schedule."""
  items = {**SHORT_RUN, "warmup_steps": warmup_steps}
  return [f"--config.{k}={v}" for k, v in items.items()]


def config_for(shape: str, *, batch: int | None = None, seq_len: int | None = None,
               tokenizer: str = "byte"):
  """Training config of `shape` on an offline corpus: the standard library's docstrings with
  the byte tokenizer (`tokenizer="byte"`), or the Python sources with a 32k SentencePiece
  model (`"python32k"`)."""
  if shape == "paper_0p5b":
    from configs import paper_0p5b  # pylint: disable=import-outside-toplevel
    c = paper_0p5b.get_config()
    c.data.update(dataset="twell_stdlib_text", tokenizer="byte", use_tfds=False)
    c.update_from_flattened_dict(SHORT_RUN)
    if batch:
      c.batch_size = batch
  elif shape == "tiny":
    from configs import tiny  # pylint: disable=import-outside-toplevel
    c = tiny.get_config()
    c.data.use_tfds = False
    c.model.dtype = "bfloat16"
    c.batch_size = batch or 8
  else:
    raise ValueError(f"unknown shape {shape!r}; expected paper_0p5b or tiny")
  if seq_len:
    c.data.seq_len = seq_len
  if tokenizer == "python32k":
    from train.corpus import build_tokenizer  # pylint: disable=import-outside-toplevel
    from train.corpus import text_corpus  # pylint: disable=import-outside-toplevel
    rec = build_tokenizer.build(PYTHON_TOKENIZER, dataset=text_corpus.SITE_NAME)
    c.data.update(dataset=text_corpus.SITE_NAME, use_tfds=False, tokenizer="sentencepiece",
                  spm_model=rec["model"])
    c.model.vocab_size = max(c.model.vocab_size, rec["options"]["vocab_size"])
  elif tokenizer != "byte":
    raise ValueError(f"tokenizer must be 'byte' or 'python32k'; got {tokenizer!r}")
  c.model.ffn_implementation = "dense"
  c.model.ffn_activation = "relu"
  c.l1_warmup_steps = 0
  c.eval_every, c.checkpoint_every = 0, 0
  return c


def repeat_layers(params, n_layers: int):
  """The trained layers repeated to n_layers (scan layout: leaves with a leading [L]): the
  deeper paper shapes' stand-in for a model trained at that depth."""
  blocks = jax.tree.map(lambda a: a[jnp.arange(n_layers) % a.shape[0]], params["blocks"])
  return {**params, "blocks": blocks}


def _save(path: str, params) -> None:
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})


def _load(path: str, like):
  with np.load(path) as data:
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = [jnp.asarray(data[jax.tree_util.keystr(k)]) for k, _ in flat]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def train(cfg, steps: int, *, params=None, log_every: int = 100):
  """Trains `steps` steps from `params` (None: a fresh init); returns (params, last metrics)."""
  from train.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
  from train.state import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  tr = trainer_lib.Trainer(cfg)
  state = tr.new_state(jax.random.key(cfg.seed))
  if params is not None:
    state = {**state, "params": params, "opt_state": tr.tx.init(params)}
  packer = data_lib.PackedBatches(
      data_lib.make_source(cfg.data, cfg.data.train_split), tr.tokenizer,
      seq_len=cfg.data.seq_len, rows=cfg.batch_size, seed=cfg.seed)
  step_fn = tr.jit_train_step()
  shape = (1, cfg.batch_size, cfg.data.seq_len + 1)
  t0, metrics = time.time(), {}
  for i in range(steps):
    state, metrics = step_fn(state, tr.put_batch(packer.next_batch().reshape(shape),
                                                 tr.batch_sharding))
    if (i + 1) % log_every == 0 or i + 1 == steps:
      m = jax.device_get(metrics)
      act = " ".join(f"{a:.1f}" for a in np.asarray(m["active_per_token"]))
      print(f"  step {i + 1}/{steps} ({time.time() - t0:.0f}s) loss {float(m['loss']):.3f} "
            f"ce {float(m['cross_entropy']):.3f} active/token {act}", flush=True)
  return state["params"], jax.device_get(metrics)


def trained_params(shape: str, level: str, *, steps: int, extreme_steps: int,
                   cache_dir: str = DEFAULT_CACHE, tokenizer: str = "byte"):
  """(config, params) of `shape` trained to `level` ("paper" or "extreme") on the corpus of
  `tokenizer` (`config_for`), cached."""
  if level not in ("paper", "extreme"):
    raise ValueError(f"level must be 'paper' or 'extreme'; got {level!r}")
  from train.state import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  cfg = config_for(shape, tokenizer=tokenizer)
  cfg.l1_coeff = PAPER_L1 if level == "paper" else EXTREME_L1
  os.makedirs(cache_dir, exist_ok=True)
  name = f"{shape}_paper_{steps}" if level == "paper" else (
      f"{shape}_extreme_{steps}_{extreme_steps}")
  if tokenizer != "byte":
    name += f"_{tokenizer}"
  path = os.path.join(cache_dir, name + ".npz")
  like = jax.eval_shape(trainer_lib.Trainer(cfg).lm.init_params, jax.random.key(0))
  if os.path.exists(path):
    logging.info("trained weights from the cache: %s", path)
    return cfg, _load(path, like)
  t0 = time.time()
  if level == "paper":
    print(f"training {shape} to the paper-like level: {steps} steps, L1 {PAPER_L1}", flush=True)
    params, _ = train(cfg, steps)
  else:
    _, start = trained_params(shape, "paper", steps=steps, extreme_steps=extreme_steps,
                              cache_dir=cache_dir, tokenizer=tokenizer)
    print(f"training {shape} on to the extreme level: {extreme_steps} steps, L1 {EXTREME_L1}",
          flush=True)
    params, _ = train(cfg, extreme_steps, params=start)
  print(f"  trained in {time.time() - t0:.0f}s", flush=True)
  _save(path, params)
  return cfg, params


def batches(cfg, rows: int, n: int):
  """`n` packed batches [rows, seq_len + 1] of the config's training data (a fixed seed off the
  training stream's)."""
  from train.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
  from train.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  packer = data_lib.PackedBatches(
      data_lib.make_source(cfg.data, cfg.data.train_split),
      tokenizer_lib.make_tokenizer(cfg.data), seq_len=cfg.data.seq_len, rows=rows,
      seed=cfg.seed + 7)
  return [jnp.asarray(packer.next_batch()) for _ in range(n)]
