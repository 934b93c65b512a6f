"""Checks of a training config's values, before any work.

`check(cfg, n_devices, n_processes)` runs before the model, the data pipeline or any
compile exists: every numeric field against its range, every choice against its
options, the batch against the devices, and the FFN implementation against this
backend. The first problem raises a `ConfigError` naming the field
(`config.<path>`), the value and what is allowed. A resumed workdir's stored config and the
changes to it: `train.config.workdir`.
"""

import math
import os

from train import errors
from train.data import files as files_lib
from train.data import tokenizer as tokenizer_lib
from train.models import implementations
from train.models import layer_choice
from train.models import transformer as model_lib


ConfigError = errors.ConfigError


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
    "data.seq_len": 1, "data.prefetch": 1, "data.workers": -1, "layer_choice.every": 1,
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
    "layer_choice.build_timeout_s": (0.0, math.inf, False, False),
    "data.eval_fraction": (0.0, 1.0, False, False),
}
_BOOLS = ("dead_reinit", "model.ffn_gated", "model.remat", "model.scan_layers",
          "model.scan_unroll", "model.interpret", "data.use_tfds", "layer_choice.enabled",
          "layer_choice.background", "layer_choice.bridge", "layer_choice.column_floor",
          "layer_choice.landing_by_layers", "layer_choice.wait_for_builds",
          "layer_choice.sparse_eval",
          "mesh.shard_optimizer")


def _choices() -> dict[str, tuple]:
  from twell_jax import dense  # pylint: disable=g-import-not-at-top
  from train.runtime import mesh  # pylint: disable=g-import-not-at-top
  return {
      "l1_normalization": ("per_token_sum", "per_element_mean"),
      "model.ffn_activation": tuple(dense.ACTIVATIONS),
      "model.ffn_implementation": (*implementations.AUTO, *implementations.FFN),
      "model.dtype": tuple(model_lib.DTYPES),
      "model.param_dtype": tuple(model_lib.DTYPES),
      "model.attention": implementations.ATTENTION,
      "data.tokenizer": tokenizer_lib.TOKENIZERS,
      "data.text_unit": files_lib.TEXT_UNITS,
      "layer_choice.sparse": ("auto", *implementations.FFN),
      "mesh.gradient_reduction": mesh.GRADIENT_REDUCTIONS,
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
  ahead = _get(cfg, "layer_choice.ahead")
  if ahead is not _MISSING:
    if not isinstance(ahead, str):
      raise ConfigError(f"config.layer_choice.ahead={ahead!r}: must be a string such as "
                        "'256,1024:last'")
    try:
      layer_choice.parse_ahead(ahead)
    except ValueError as e:
      raise ConfigError(f"config.layer_choice.ahead={ahead!r}: {e}") from None
  scales, n_layers = _get(cfg, "l1_layer_scales"), _get(cfg, "model.n_layers")
  if scales is not _MISSING and n_layers is not _MISSING:
    try:
      if not isinstance(scales, str):
        raise ValueError("must be a string such as '1,0.5,0.5,1'")
      parse_l1_layer_scales(scales, n_layers)
    except ValueError as e:
      raise ConfigError(f"config.l1_layer_scales={scales!r}: {e}") from None
  menu = _get(cfg, "layer_choice.hot_menu")
  if menu is not _MISSING:
    try:
      if not isinstance(menu, str):
        raise ValueError("must be a string such as '256,512,1024,2048'")
      layer_choice.parse_hot_menu(menu)
    except ValueError as e:
      raise ConfigError(f"config.layer_choice.hot_menu={menu!r}: {e}") from None
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
  if cfg.data.tokenizer == "hf" and not (cfg.data.get("tokenizer_file")
                                         and os.path.isfile(cfg.data.tokenizer_file)):
    raise ConfigError(f"config.data.tokenizer_file={cfg.data.get('tokenizer_file')!r}: "
                      "tokenizer='hf' needs the path of a tokenizer.json")


def _check_backend(cfg, n_devices: int):
  """The FFN implementation and the attention against this backend
  (`train.models.implementations`)."""
  mc = cfg.model
  interpret = bool(mc.get("interpret", False))
  model_cfg = model_lib.ModelConfig.from_config(mc)
  run = implementations.training(cfg, model_cfg, n_devices)
  name = run.implementation
  reason = implementations.ffn_problem(model_cfg, name, run.tokens)
  if reason is not None:
    if name == "mosaic_gpu" and not interpret:
      reason += (" (here: --config.model.interpret=True; slow, and the kernels need "
                 "model.dtype='bfloat16')")
    raise ConfigError(f"config.{run.field}={name!r} cannot run here: {reason}; 'dense' and "
                      "'xla' run on every backend")
  if name == "mosaic_gpu" and interpret and mc.remat:
    raise ConfigError("config.model.remat=True: JAX refuses jax.checkpoint under "
                      "differentiation around the interpreter's kernels "
                      "(model.interpret=True); set model.remat=False")
  problem = implementations.attention_problem(model_cfg)
  if problem is not None:
    raise ConfigError(f"config.model.attention={mc.attention!r} {problem}; use 'auto' or "
                      "'xla'")


def parse_l1_layer_scales(text: str, n_layers: int) -> tuple[float, ...] | None:
  """`config.l1_layer_scales`: "" (None: every layer's L1 counts alike) or one finite
  number >= 0 per layer, comma-separated, that multiplies the layer's L1 statistic in the
  penalty; ValueError says what is wrong."""
  if not text.strip():
    return None
  try:
    scales = tuple(float(v) for v in text.split(","))
  except ValueError:
    raise ValueError("must be numbers separated by commas, one per layer") from None
  if len(scales) != n_layers:
    raise ValueError(f"has {len(scales)} numbers for the model's {n_layers} layers")
  if not all(math.isfinite(v) and v >= 0 for v in scales):
    raise ValueError("every number must be finite and >= 0")
  return scales


def check(cfg, n_devices: int, n_processes: int):
  """Raises ConfigError for the first bad field of `cfg` (see the module docstring)."""
  _check_values(cfg)
  _check_consistency(cfg, n_devices, n_processes)
  try:
    model_lib.ModelConfig.from_config(cfg.model)
  except (TypeError, ValueError) as e:  # unknown fields, head counts
    raise ConfigError(f"config.model: {e}") from e
  _check_backend(cfg, n_devices)
