"""One decode step of causal GQA attention with its KV-cache write, in one kernel (Pallas,
Triton backend).

For each row b (one sequence) at position p_b = pos[b], each key/value head g and its G query
heads (Hq = G K):

    s_t   = q[b, h] . k[b, t, g] / sqrt(E)          t <= p_b, where k[b, p_b] = k_new[b, g]
    o[b, h] = sum_t softmax(s)_t v[b, t, g]
    cache[b, p_b, g] <- (k_new[b, g], v_new[b, g])

Cache rows t < p_b are read in blocks of ``block_t`` (an online softmax in f32; the
probabilities are rounded to the cache dtype before the product with V, as flash attention
does), the new token's key and value come from registers, and the program writes them into the
cache last: each (b, g) program owns cache[b, :, g], so no other program reads what it writes.
The caches are updated in place (aliased to the outputs).

At a decode step XLA's attention (`jax.nn.dot_product_attention`) plus the two cache scatters
run as about ten small kernels per layer (products, mask, max, exp, sum, convert), each a few
microseconds whatever its size; this is one.

The same function as XLA's up to rounding: XLA normalizes the probabilities before rounding
them to the cache dtype, this kernel divides by their sum after the product with V.

Supported: E a power of two >= 16, G <= 64 query heads per key/value head; any B, cache length
T and positions 0 <= pos < T (a position past T writes nothing and attends to the rows < T).
On a GPU the Triton backend; ``interpret=True`` runs it in the Pallas interpreter (CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _common as common
from pallas_kernels import _target as target


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
  """Cache rows per step of the loop (a power of two >= 16), warps, pipeline stages."""
  block_t: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.block_t < 16 or not common.is_pow2(self.block_t):
      raise ValueError(f"{self.block_t=} must be a power of two >= 16")
    target.check_triton_warps(self.num_warps)


def supports(q_heads: int, kv_heads: int, head_dim: int) -> Optional[str]:
  """None when ``decode_attention`` runs these heads, else the reason."""
  if kv_heads < 1 or q_heads % kv_heads:
    return f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads"
  if q_heads // kv_heads > 64:
    return f"{q_heads // kv_heads} query heads per key/value head (at most 64)"
  if head_dim < 16 or not common.is_pow2(head_dim):
    return f"head dim {head_dim} is not a power of two >= 16"
  return None


def _kernel(pos_ref, q_ref, kn_ref, vn_ref, kc_ref, vc_ref, o_ref, kc_out, vc_out, *,
            g: int, gp: int, bt: int, t_max: int, scale: float):
  b, kv = pl.program_id(0), pl.program_id(1)
  p = plt.load(pos_ref.at[pl.ds(b, 1)])[0]
  dt = kc_ref.dtype
  row_ok = jnp.arange(gp, dtype=jnp.int32) < g
  q = plt.load(q_ref.at[b, pl.ds(kv * g, gp), :], mask=row_ok[:, None], other=0)   # [gp, E]
  e = q.shape[1]
  kn = plt.load(kn_ref.at[b, kv, :])
  vn = plt.load(vn_ref.at[b, kv, :])
  cached = jnp.minimum(p, t_max)

  def block(i, carry):
    acc, m, l = carry
    t = i * bt + jnp.arange(bt, dtype=jnp.int32)
    t_ok = t < cached
    k = plt.load(kc_ref.at[b, pl.ds(i * bt, bt), kv, :], mask=t_ok[:, None], other=0)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * scale        # [gp, bt]
    s = jnp.where(t_ok[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    pr = jnp.exp(s - m_new[:, None])
    v = plt.load(vc_ref.at[b, pl.ds(i * bt, bt), kv, :], mask=t_ok[:, None], other=0)
    acc = acc * corr[:, None] + jnp.dot(pr.astype(dt), v, preferred_element_type=jnp.float32)
    return acc, m_new, l * corr + jnp.sum(pr, axis=1)

  init = (jnp.zeros((gp, e), jnp.float32), jnp.full((gp,), -jnp.inf, jnp.float32),
          jnp.zeros((gp,), jnp.float32))
  acc, m, l = lax.fori_loop(0, pl.cdiv(cached, bt), block, init)
  # The new token, from registers.
  s_new = jnp.sum(q.astype(jnp.float32) * kn.astype(jnp.float32)[None, :], axis=1) * scale
  m_new = jnp.maximum(m, s_new)
  corr = jnp.exp(m - m_new)
  pn = jnp.exp(s_new - m_new).astype(dt).astype(jnp.float32)
  l = l * corr + jnp.exp(s_new - m_new)
  acc = acc * corr[:, None] + pn[:, None] * vn.astype(jnp.float32)[None, :]
  o = (acc / l[:, None]).astype(o_ref.dtype)
  plt.store(o_ref.at[b, pl.ds(kv * g, gp), :], o, mask=row_ok[:, None])
  write = jnp.broadcast_to(p < t_max, (e,))
  plt.store(kc_out.at[b, jnp.minimum(p, t_max - 1), kv, :], kn, mask=write)
  plt.store(vc_out.at[b, jnp.minimum(p, t_max - 1), kv, :], vn, mask=write)


def decode_attention(q, k_new, v_new, k_cache, v_cache, pos, *,
                     config: AttentionConfig = AttentionConfig(), interpret: bool = False):
  """(o [B, Hq, E], k_cache, v_cache updated) of one decode step (module docstring).

  q [B, Hq, E], k_new / v_new [B, K, E] (RoPE applied), k_cache / v_cache [B, T, K, E]
  (updated in place where the caller donates them), pos [B] int32."""
  b, hq, e = q.shape
  _, t_max, kh, _ = k_cache.shape
  reason = supports(hq, kh, e)
  if reason is not None:
    raise ValueError(f"decode_attention: {reason}")
  if (k_new.shape != (b, kh, e) or v_new.shape != k_new.shape
      or k_cache.shape != (b, t_max, kh, e) or v_cache.shape != k_cache.shape
      or pos.shape != (b,)):
    raise ValueError(f"decode_attention: bad shapes q {q.shape}, k_new {k_new.shape}, v_new "
                     f"{v_new.shape}, caches {k_cache.shape} {v_cache.shape}, pos {pos.shape}")
  g = hq // kh
  gp = common.pow2_at_least(g, 16)
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  f = pl.pallas_call(
      functools.partial(_kernel, g=g, gp=gp, bt=config.block_t, t_max=t_max,
                        scale=1.0 / math.sqrt(e)),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
      grid=(b, kh),
      in_specs=[anywhere] * 6,
      out_specs=[anywhere] * 3,
      input_output_aliases={4: 1, 5: 2},
      compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                         num_stages=config.num_stages),
      interpret=interpret,
      name="twell_decode_attention",
  )
  cast = lambda a: a.astype(k_cache.dtype)
  return f(pos.astype(jnp.int32), cast(q), cast(k_new), cast(v_new), k_cache, v_cache)
