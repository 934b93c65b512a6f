"""The "dense" implementation (plain XLA, the speed baseline) and the f32 reference."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from twell_jax import stats as stats_lib

__all__ = ["ACTIVATIONS", "dense_ffn", "reference_ffn"]

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
}


def _hidden(x, w_gate, w_up, activation: str, out_dtype):
  """h [M, H] (f32 math, rounded to out_dtype) and the activity mask."""
  act = ACTIVATIONS[activation]
  f32 = jnp.float32
  if w_gate is None:
    pre = jnp.dot(x, w_up, preferred_element_type=f32)
    h = act(pre)
  else:
    pre = jnp.dot(x, w_gate, preferred_element_type=f32)
    h = act(pre) * jnp.dot(x, w_up, preferred_element_type=f32)
  h = h.astype(out_dtype)
  active = pre > 0 if activation == "relu" else h != 0
  return h, active


def dense_ffn(x, w_gate: Optional[jax.Array], w_up, w_down, activation: str = "relu"):
  """Dense FFN on x [M, D]: h = act(x Wg) * (x Wu) (or act(x Wu)); y = h Wd.

  bf16 (x.dtype) operands, f32 accumulation, h rounded to x.dtype before the
  down projection, as a bf16 XLA model would run it. Returns (y, FFNStats).
  """
  h, active = _hidden(x, w_gate, w_up, activation, x.dtype)
  y = jnp.dot(h, w_down, preferred_element_type=jnp.float32).astype(x.dtype)
  l1 = jnp.sum(jnp.abs(h.astype(jnp.float32))) / x.shape[0]
  nnz, max_tile, fired = stats_lib.tile_stats(active)
  stats = stats_lib.FFNStats(l1=l1, nnz_per_token=nnz, max_tile_nnz=max_tile,
                             overflow_rows=jnp.zeros((), jnp.int32), fired=fired)
  return y, stats


def reference_ffn(x, w_gate, w_up, w_down, activation: str = "relu"):
  """f32 reference: everything in float32 at HIGHEST precision. Returns (y, l1).

  x [..., D]; y has x's leading shape and dtype float32. Differentiable with
  plain jax.grad; the tests compare every implementation against it.
  """
  f32 = jnp.float32
  hp = jax.lax.Precision.HIGHEST
  act = ACTIVATIONS[activation]
  x = jnp.asarray(x, f32)
  up = jnp.matmul(x, jnp.asarray(w_up, f32), precision=hp)
  if w_gate is None:
    h = act(up)
  else:
    h = act(jnp.matmul(x, jnp.asarray(w_gate, f32), precision=hp)) * up
  y = jnp.matmul(h, jnp.asarray(w_down, f32), precision=hp)
  tokens = max(1, h.size // h.shape[-1])
  l1 = jnp.sum(jnp.abs(h)) / tokens
  return y, l1
