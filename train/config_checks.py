"""Checks of a training config: its values before any work, its changes on a resumed workdir.

`check(cfg, n_devices, n_processes)` runs before the model, the data pipeline or any
compile exists: every numeric field against its range, every choice against its
options, the batch against the devices, and the FFN implementation against this
backend. The first problem raises a `ConfigError` naming the field
(`config.<path>`), the value and what is allowed.

`check_change(stored, requested, accept=...)` compares the config a workdir was
trained with (WORKDIR/config.json) with the one a rerun asks for. Each field is
in one of three classes:
  * free: how the run is observed or executed, not what it computes (log, eval
    and checkpoint cadence, the FFN implementation and kernels, remat, the scan
    unrolled, where the data lives): applied and logged;
  * accepted on request: the optimisation of the remaining steps (schedule,
    optimizer, L1, number of steps, compute dtype): the checkpoints still fit,
    but the run is no longer the one that was started, so the rerun needs
    `--accept_config_change`;
  * everything else (model shapes and parameter layout, the seed, the data
    stream: dataset, tokenizer, sequence length, batch size) would not fit the
    checkpoints or would silently change the data: refused, with the fields
    listed, before any checkpoint is touched.
Fields missing from one side (added or removed by a newer version of the code)
are not compared.
"""

import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from train import model as model_lib


class ConfigError(ValueError):
  """A config that cannot run; train.main prints it without a traceback."""


_MISSING = object()


def _get(cfg, path: str):
  node = cfg
  for key in path.split("."):
    try:
      node = node[key]
    except (KeyError, TypeError, AttributeError):
      return _MISSING
  return node


# Integer fields: the smallest allowed value.
_INT_MIN = {
    "seed": 0, "num_train_steps": 1, "batch_size": 1, "grad_accum_steps": 1,
    "warmup_steps": 0, "l1_warmup_steps": 0, "dead_window_tokens": 1,
    "dead_reinit_every": 1, "log_every": 1, "eval_every": 0, "eval_batches": 1,
    "checkpoint_every": 0, "keep_checkpoints": 1,
    "model.vocab_size": 1, "model.d_model": 1, "model.n_layers": 1, "model.n_heads": 1,
    "model.n_kv_heads": 1, "model.d_ff": 1,
    "data.seq_len": 1, "data.prefetch": 1, "layer_choice.every": 1,
    "layer_choice.landing_steps": 0,
    "profile.first_step": 0, "profile.steps": 0,
}
# Float fields: (low, high, low included, high included); every value must be finite.
_FLOAT_RANGE = {
    "learning_rate": (0.0, math.inf, True, False),
    "min_lr_ratio": (0.0, 1.0, True, True),
    "adam_b1": (0.0, 1.0, True, False),
    "adam_b2": (0.0, 1.0, True, False),
    "adam_eps": (0.0, math.inf, False, False),
    "weight_decay": (0.0, math.inf, True, False),
    "grad_clip": (0.0, math.inf, False, False),
    "l1_coeff": (0.0, math.inf, True, False),
    "model.rope_theta": (0.0, math.inf, False, False),
    "model.norm_eps": (0.0, math.inf, False, False),
    "model.init_std": (0.0, math.inf, False, False),
    "layer_choice.sparse_below": (0.0, math.inf, True, False),
    "layer_choice.dense_above": (0.0, math.inf, True, False),
}
_BOOLS = ("dead_reinit", "model.ffn_gated", "model.remat", "model.scan_layers",
          "model.scan_unroll", "model.interpret", "data.use_tfds", "layer_choice.enabled",
          "layer_choice.background", "mesh.shard_optimizer")


def _choices() -> dict[str, tuple]:
  from twell_jax import api  # pylint: disable=g-import-not-at-top
  from twell_jax import dense  # pylint: disable=g-import-not-at-top
  from train import steps  # pylint: disable=g-import-not-at-top
  return {
      "l1_normalization": ("per_token_sum", "per_element_mean"),
      "model.ffn_activation": tuple(dense.ACTIVATIONS),
      "model.ffn_implementation": (None, "", "auto", *api.IMPLEMENTATIONS),
      "model.dtype": tuple(model_lib.DTYPES),
      "model.param_dtype": tuple(model_lib.DTYPES),
      "model.attention": model_lib.ATTENTION_IMPLEMENTATIONS,
      "data.tokenizer": ("byte", "sentencepiece"),
      "layer_choice.sparse": ("auto", *api.IMPLEMENTATIONS),
      "mesh.gradient_reduction": steps.GRADIENT_REDUCTIONS,
  }


def _range_text(lo, hi, lo_in, hi_in) -> str:
  left = f"{'>=' if lo_in else '>'} {lo:g}"
  return left if hi == math.inf else f"{left} and {'<=' if hi_in else '<'} {hi:g}"


def _check_values(cfg):
  for path, lo in _INT_MIN.items():
    v = _get(cfg, path)
    if v is _MISSING:
      continue
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise ConfigError(f"config.{path}={v!r}: must be an integer >= {lo}")
  for path, (lo, hi, lo_in, hi_in) in _FLOAT_RANGE.items():
    v = _get(cfg, path)
    if v is _MISSING:
      continue
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi))
    if not ok:
      raise ConfigError(f"config.{path}={v!r}: must be a finite number "
                        f"{_range_text(lo, hi, lo_in, hi_in)}")
  for path in _BOOLS:
    v = _get(cfg, path)
    if v is not _MISSING and not isinstance(v, bool):
      raise ConfigError(f"config.{path}={v!r}: must be True or False")
  for path, options in _choices().items():
    v = _get(cfg, path)
    if v is not _MISSING and v not in options:
      raise ConfigError(f"config.{path}={v!r}: must be one of {options}")


def _check_consistency(cfg, n_devices: int, n_processes: int):
  if cfg.batch_size % cfg.grad_accum_steps:
    raise ConfigError(f"config.batch_size={cfg.batch_size} must be divisible by "
                      f"config.grad_accum_steps={cfg.grad_accum_steps}")
  micro = cfg.batch_size // cfg.grad_accum_steps
  if micro % n_devices:
    raise ConfigError(f"config.batch_size: the micro-batch {micro} (batch_size / "
                      f"grad_accum_steps) must be divisible by the {n_devices} devices")
  if cfg.batch_size % n_processes:
    raise ConfigError(f"config.batch_size={cfg.batch_size} must be divisible by the "
                      f"{n_processes} processes")
  lc = cfg.get("layer_choice")
  if lc is not None and lc.dense_above < lc.sparse_below:
    raise ConfigError(f"config.layer_choice.dense_above={lc.dense_above} must be >= "
                      f"config.layer_choice.sparse_below={lc.sparse_below}")
  if cfg.data.tokenizer == "sentencepiece" and not (cfg.data.spm_model
                                                   and os.path.isfile(cfg.data.spm_model)):
    raise ConfigError(f"config.data.spm_model={cfg.data.spm_model!r}: "
                      "tokenizer='sentencepiece' needs the path of a SentencePiece model file")


def _sparse_implementation(cfg, tokens: int) -> tuple[str, str]:
  """(config field, implementation) of the FFN the run uses where it is not dense."""
  from twell_jax import api  # pylint: disable=g-import-not-at-top
  mc = cfg.model
  named = mc.ffn_implementation
  if named not in (None, "", "auto"):
    return "model.ffn_implementation", named
  lc = cfg.get("layer_choice")
  if lc is not None and lc.enabled and lc.sparse != "auto" and mc.ffn_activation == "relu":
    return "layer_choice.sparse", lc.sparse
  dt = model_lib.DTYPES[mc.dtype]
  sds = jax.ShapeDtypeStruct
  picked = api.default_implementation(
      sds((tokens, mc.d_model), dt), sds((mc.d_model, mc.d_ff), dt) if mc.ffn_gated else None,
      sds((mc.d_model, mc.d_ff), dt), sds((mc.d_ff, mc.d_model), dt), mc.ffn_activation,
      interpret=bool(mc.get("interpret", False)))
  return "model.ffn_implementation", picked


def _check_backend(cfg, n_devices: int):
  """The FFN implementation and the attention kernel against this backend."""
  from twell_jax import registry  # pylint: disable=g-import-not-at-top
  mc = cfg.model
  interpret = bool(mc.get("interpret", False))
  tokens = max(1, cfg.batch_size // cfg.grad_accum_steps // n_devices) * cfg.data.seq_len
  field, name = _sparse_implementation(cfg, tokens)
  call = registry.Call(m=tokens, d=mc.d_model, h=mc.d_ff, gated=mc.ffn_gated,
                       dtype=jnp.dtype(model_lib.DTYPES[mc.dtype]),
                       activation=mc.ffn_activation, interpret=interpret, ell_width=128,
                       tail_rows=None)
  reason = registry.get(name).unsupported(call)
  if reason is not None:
    if name == "mosaic_gpu" and not interpret:
      reason += (" (here: --config.model.interpret=True; slow, and the kernels need "
                 "model.dtype='bfloat16')")
    raise ConfigError(f"config.{field}={name!r} cannot run here: {reason}; 'dense' and "
                      "'xla' run on every backend")
  if name == "mosaic_gpu" and interpret and mc.remat:
    raise ConfigError("config.model.remat=True: JAX refuses jax.checkpoint under "
                      "differentiation around the interpreter's kernels "
                      "(model.interpret=True); set model.remat=False")
  if mc.attention == "cudnn" and jax.default_backend() != "gpu":
    raise ConfigError(f"config.model.attention='cudnn' needs a GPU (default backend is "
                      f"{jax.default_backend()!r}); use 'auto' or 'xla'")


def check(cfg, n_devices: int, n_processes: int):
  """Raises ConfigError for the first bad field of `cfg` (see the module docstring)."""
  _check_values(cfg)
  _check_consistency(cfg, n_devices, n_processes)
  try:
    model_lib.ModelConfig.from_config(cfg.model)
  except (TypeError, ValueError) as e:  # unknown fields, head counts
    raise ConfigError(f"config.model: {e}") from e
  _check_backend(cfg, n_devices)


# ----------------------------------------------------------------------------
# A workdir's config and changes to it
# ----------------------------------------------------------------------------

CONFIG_FILE = "config.json"

# Changes applied without asking (observation and execution, not the computation).
_FREE = ("log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
         "data.data_dir", "data.use_tfds", "data.prefetch", "data.eval_split",
         "model.ffn_implementation", "model.attention", "model.remat", "model.scan_unroll",
         "model.interpret", "layer_choice.", "mesh.", "init_from_hf.", "compilation_cache_dir",
         "profile.")
# Changes that fit the checkpoints but change the rest of the run: need the flag.
_ACCEPTABLE = ("num_train_steps", "learning_rate", "warmup_steps", "min_lr_ratio",
               "adam_b1", "adam_b2", "adam_eps", "weight_decay", "grad_clip",
               "grad_accum_steps", "l1_coeff", "l1_warmup_steps", "l1_normalization",
               "dead_window_tokens", "dead_reinit", "dead_reinit_every", "model.dtype")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _in(path: str, fields: tuple) -> bool:
  return any(path == f or (f.endswith(".") and path.startswith(f)) for f in fields)


def changes(stored: dict, requested: dict) -> dict[str, list[tuple[str, Any, Any]]]:
  """{"free" | "acceptable" | "refused": [(field, stored, requested)]} of the fields in both."""
  a, b = _flatten(stored), _flatten(requested)
  out = {"free": [], "acceptable": [], "refused": []}
  for path in sorted(a.keys() & b.keys()):
    if a[path] == b[path]:
      continue
    kind = "free" if _in(path, _FREE) else "acceptable" if _in(path, _ACCEPTABLE) else "refused"
    out[kind].append((path, a[path], b[path]))
  return out


def _lines(items) -> str:
  return "; ".join(f"{path}: {old!r} -> {new!r}" for path, old, new in items)


def check_change(stored: dict | None, requested: dict, *, accept: bool, where: str):
  """Raises ConfigError unless `requested` may continue a run trained with `stored`.

  Returns the changes that apply (see `changes`) for the log. `where` names the
  stored config in messages.
  """
  if stored is None:
    return {"free": [], "acceptable": [], "refused": []}
  diff = changes(stored, requested)
  if diff["refused"]:
    msg = (f"this config does not fit the run in {where}: {_lines(diff['refused'])} "
           "(model shapes, parameter layout, seed or data stream). Nothing was changed. "
           "Rerun with the stored values, or start the new config in a new --workdir")
    if diff["acceptable"]:
      msg += (f". Also changed, acceptable with --accept_config_change: "
              f"{_lines(diff['acceptable'])}")
    raise ConfigError(msg)
  if diff["acceptable"] and not accept:
    raise ConfigError(
        f"this config changes the run in {where}: {_lines(diff['acceptable'])}. The "
        "checkpoints fit, but the remaining steps would differ from the run that was "
        "started. Nothing was changed. Rerun with --accept_config_change to continue with "
        "the new values, or with the stored ones")
  return diff


def check_workdir(workdir: str, requested: dict, *, accept: bool) -> dict:
  """`check_change` of `requested` against the run in `workdir`, if it has checkpoints.

  The stored config is WORKDIR/config.json, else the one in the latest checkpoint's
  metadata. A workdir without checkpoints has nothing to protect: no comparison.
  """
  from train import checkpointing  # pylint: disable=g-import-not-at-top
  if not checkpointing.steps_on_disk(workdir):
    return check_change(None, requested, accept=accept, where=workdir)
  stored, where = read_workdir_config(workdir), os.path.join(workdir, CONFIG_FILE)
  if stored is None:
    try:
      step, meta = checkpointing.read_meta(workdir)
    except checkpointing.CheckpointError:
      stored = None   # the restore reports the damage
    else:
      stored, where = meta.get("config"), f"checkpoint step {step} of {workdir}"
  return check_change(stored, requested, accept=accept, where=where)


def read_workdir_config(workdir: str) -> dict | None:
  """The config stored in WORKDIR/config.json, or None if there is none."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path} is unreadable ({e}); it records the config this workdir "
                      "was trained with: restore it, or move it aside to resume with the "
                      "config saved in the latest checkpoint") from e


def write_workdir_config(workdir: str, config: dict):
  """Writes WORKDIR/config.json atomically (a complete old or new file after any crash)."""
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(config, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
