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

  Plain x.dtype products (`x @ w`: XLA accumulates bf16 GEMMs in f32 and
  rounds the output), as a bf16 model is usually written. The backward's
  cotangents are then x.dtype too, so every backward GEMM is a bf16 GEMM on
  the tensor cores. (Asking for f32 outputs and casting would make the
  cotangents f32 and the backward GEMMs f32 x bf16: measured 2.2x slower
  forward + backward on an H100 at the paper's shape.)
  """
  act = ACTIVATIONS[activation]
  dot = jnp.dot
  if w_gate is None:
    pre = dot(x, w_up)
    h = act(pre)
  else:
    pre = dot(x, w_gate)
    h = act(pre) * dot(x, w_up)
  active = pre > 0 if activation == "relu" else h != 0
  return h.astype(x.dtype), active


def dense_ffn(x, w_gate: Optional[jax.Array], w_up, w_down, activation: str = "relu"):
  """Dense FFN on x [M, D]: h = act(x Wg) * (x Wu) (or act(x Wu)); y = h Wd.

  bf16 (x.dtype) operands and products (f32 accumulation inside each GEMM),
  as a bf16 XLA model runs it. Returns (y, FFNStats).
  """
  h, active = _hidden(x, w_gate, w_up, activation)
  y = jnp.dot(h, w_down)
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
