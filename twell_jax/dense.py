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


def _hidden(x, w_gate, w_up, activation: str):
  """h [M, H] in x.dtype and the activity mask.

  Each product accumulates in f32 and is rounded to x.dtype right away, as a
  bf16 XLA model does: the backward's cotangents are then x.dtype too, so
  every backward GEMM runs in bf16 on the tensor cores (keeping f32
  intermediates would turn them into f32 x bf16 GEMMs, about 2x slower).
  """
  act = ACTIVATIONS[activation]
  dt = x.dtype
  dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dt)
  if w_gate is None:
    pre = dot(x, w_up)
    h = act(pre)
  else:
    pre = dot(x, w_gate)
    h = act(pre) * dot(x, w_up)
  active = pre > 0 if activation == "relu" else h != 0
  return h.astype(dt), active


def dense_ffn(x, w_gate: Optional[jax.Array], w_up, w_down, activation: str = "relu"):
  """Dense FFN on x [M, D]: h = act(x Wg) * (x Wu) (or act(x Wu)); y = h Wd.

  bf16 (x.dtype) operands, f32 accumulation, every product rounded to
  x.dtype, as a bf16 XLA model runs it. Returns (y, FFNStats).
  """
  h, active = _hidden(x, w_gate, w_up, activation)
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
