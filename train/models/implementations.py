"""Which FFN implementation a model's layer runs here: one answer for the trainer, the config
check and generation.

`implementation(model_cfg, tokens)` is the named implementation (`model.ffn_implementation`,
or `name`), else what `twell_jax.ffn(implementation=None)` picks for one call of `tokens`
rows of this model on this backend (`twell_jax.registry.pick`: the kernels where they run and
were measured faster than dense at this shape, else dense). `call(model_cfg, tokens)` is that
call's `twell_jax.registry.Call`, for asking an implementation whether it runs it.
`tokens_per_call(cfg, n_devices)`: the rows of one FFN call in a train step, a micro-batch's
share of one device.
"""

from __future__ import annotations

import jax.numpy as jnp

from twell_jax import registry

AUTO = (None, "", "auto")


def tokens_per_call(cfg, n_devices: int) -> int:
  """Rows of one FFN call in a train step of `cfg` on `n_devices` devices (at least one
  sequence)."""
  return max(1, cfg.batch_size // cfg.grad_accum_steps // n_devices) * cfg.data.seq_len


def call(model_cfg, tokens: int, *, ell_width: int = 128) -> registry.Call:
  """The `registry.Call` of one FFN call of `model_cfg` (a `train.models.transformer.
  ModelConfig`) on `tokens` rows."""
  from train.models import transformer  # pylint: disable=import-outside-toplevel
  return registry.Call(m=tokens, d=model_cfg.d_model, h=model_cfg.d_ff,
                       gated=model_cfg.ffn_gated,
                       dtype=jnp.dtype(transformer.DTYPES[model_cfg.dtype]),
                       activation=model_cfg.ffn_activation,
                       interpret=bool(model_cfg.interpret), ell_width=ell_width,
                       tail_rows=None)


def implementation(model_cfg, tokens: int, name: str | None = None) -> str:
  """The FFN implementation a layer runs on `tokens` rows (module docstring)."""
  name = model_cfg.ffn_implementation if name is None else name
  if name not in AUTO:
    return name
  return registry.pick(call(model_cfg, tokens)).name
