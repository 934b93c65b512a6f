"""Per-layer sparsity bookkeeping: the L1 term, dead features, re-init.

Dead features. For every layer l and hidden feature j the trainer keeps
`since[l, j]` (int32 [L, H]): training tokens seen since feature j last fired
(h != 0 for some token; `FFNStats.fired`). After a step over n tokens:
  since = 0 where fired, else min(since + n, 2^30)   (saturates: no overflow)
A feature is dead when since >= window (config.dead_window_tokens). This is
exact at step granularity: a feature counts as alive for the whole step in
which it fired.

Re-initialization (config.dead_reinit, every dead_reinit_every steps): for a
dead feature j of a gated FFN, the gate column w_gate[:, j] is redrawn from
N(0, init_std^2) (for a non-gated FFN, w_up[:, j], which is its gate), its
Adam moments are zeroed so stale statistics do not steer the fresh column,
and since[l, j] restarts at 0. w_up[:, j] and w_down[j, :] are kept: a dead
feature's h is 0, so they received no loss gradient and only shrank under
weight decay; a fresh gate lets them learn again from where they are, and
the small w_down row keeps the revived feature from disturbing the output.
"""

import jax
import jax.numpy as jnp
import optax

from train.models import transformer as model_lib

_SATURATE = 1 << 30


def l1_term(l1_per_layer: jax.Array, d_ff: int, normalization: str):
  """Mean over layers of the L1 statistic, in the chosen normalization.

  l1_per_layer [L]: FFNStats.l1 = mean over tokens of sum over H of |h|.
  "per_token_sum" returns its mean over layers; "per_element_mean" divides by
  H first (the mean over all M*H entries written in the paper).
  """
  if normalization == "per_token_sum":
    return jnp.mean(l1_per_layer)
  if normalization == "per_element_mean":
    return jnp.mean(l1_per_layer) / d_ff
  raise ValueError(f"l1_normalization={normalization!r}: expected "
                   "'per_token_sum' or 'per_element_mean'")


def init_since(n_layers: int, d_ff: int) -> jax.Array:
  return jnp.zeros((n_layers, d_ff), jnp.int32)


def update_since(since: jax.Array, fired: jax.Array, n_tokens: int):
  """since [L, H] int32, fired [L, H] bool -> updated counters."""
  # since <= 2^30 and n_tokens < 2^30, so the int32 sum cannot overflow.
  grown = jnp.minimum(since + jnp.int32(min(n_tokens, _SATURATE)), _SATURATE)
  return jnp.where(fired, 0, grown)


def dead_mask(since: jax.Array, window: int) -> jax.Array:
  return since >= window


def reinit_dead(params: dict, opt_state, tx, since: jax.Array, window: int,
                key: jax.Array, init_std: float):
  """Redraws dead gate columns; returns (params, opt_state, since, n_reinit).

  Works for both layer layouts of train.models.transformer (loop and scan): the FFN
  weights are viewed stacked as [L, D, H] and written back.
  """
  n_layers = since.shape[0]
  dead = dead_mask(since, window)  # [L, H]
  ffn = model_lib.stacked_ffn(params, n_layers)
  name = "w_gate" if "w_gate" in ffn else "w_up"  # non-gated: w_up gates
  w = ffn[name]  # [L, D, H]
  fresh = (init_std * jax.random.normal(key, w.shape, jnp.float32)).astype(
      w.dtype)
  cols = dead[:, None, :]  # [L, 1, H]
  params = model_lib.with_stacked_ffn(params, {name: jnp.where(cols, fresh,
                                                                w)})
  # A tree shaped like the params: True on the revived columns of the gate
  # (broadcast over D), False elsewhere; it selects the Adam moments to zero.
  no = jax.tree.map(lambda p: jnp.zeros((), bool), params)
  masks = model_lib.with_stacked_ffn(no, {name: cols})

  def zero_moments(leaf, mask):
    return jnp.where(mask, jnp.zeros_like(leaf), leaf)

  opt_state = optax.tree_utils.tree_map_params(tx, zero_moments, opt_state,
                                               masks)
  since = jnp.where(dead, 0, since)
  return params, opt_state, since, jnp.sum(dead)
