"""Cross-entropy against a tied embedding, in chunks, without f32 [tokens, vocab] logits.

The LM head is the largest GEMM of a small model's step (2 N D V FLOPs per pass: 2.1 TFLOP for
16k tokens at D = 2048, V = 32k). `cross_entropy_sum` computes it in bf16 (the compute dtype)
with f32 accumulation, one chunk of tokens at a time: a chunk's logits [C, V] f32 live only
inside the chunk, and the log-sum-exp, the target logit and, under differentiation, the
gradient of the chunk come out of them at once. Differentiated, the forward rule computes the
loss and both gradients (tokens and embedding) in the same pass, so the backward needs no
second logits GEMM; the gradients are linear in the loss's cotangent, which scales them.

Under a mesh with batch axes in context (the trainer traces its steps under its mesh) both
entry points run under `jax.shard_map` like the FFN (`twell_jax.sharded`): each device takes
its own tokens in chunks against the whole embedding (gathered once under FSDP), the sums
are added over the batch axes, and the embedding's gradient is reduced by the transpose. A
chunked scan over the global tokens would instead split every chunk over the devices and
reduce the [V, D] gradient once per chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from twell_jax import sharded

_F32 = jnp.float32
DEFAULT_CHUNK = 4096


def _chunks(x, targets, chunk: int):
  n = x.shape[0]
  c = min(chunk, n)
  pad = (-n) % c
  # Padded tokens get target -1: no target logit, and masked out of every sum.
  x = jnp.pad(x, ((0, pad), (0, 0)))
  targets = jnp.pad(targets, (0, pad), constant_values=-1)
  return x.reshape(-1, c, x.shape[1]), targets.reshape(-1, c)


def _chunk_terms(xc, w, tc):
  """(logits [C, V] f32, per-token CE [C] f32 (0 where tc < 0), valid [C])."""
  logits = jnp.dot(xc, w.T, preferred_element_type=_F32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  valid = tc >= 0
  tgt = jnp.take_along_axis(logits, jnp.maximum(tc, 0)[:, None], axis=1)[:, 0]
  return logits, jnp.where(valid, lse - tgt, 0.0), valid


def _shard_map(local, axes, out_spec):
  return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                       in_specs=(P(axes), P(), P(axes)), out_specs=out_spec,
                       axis_names=frozenset(axes), check_vma=False)


def per_token_cross_entropy(x, embed, targets, chunk: int = DEFAULT_CHUNK):
  """CE [N] f32 of tokens x [N, D] (compute dtype) against embed [V, D]; not for autodiff."""
  axes = sharded.split_axes(x.shape[0])
  if not axes:
    return _per_token_ce(x, embed, targets, chunk)
  local = functools.partial(_per_token_ce, chunk=chunk)
  # Cast before the map: an FSDP gather of the table moves the compute dtype's bytes.
  return _shard_map(local, axes, P(axes))(x, embed.astype(x.dtype), targets)


def cross_entropy_sum(x, embed, targets, chunk: int = DEFAULT_CHUNK):
  """Sum over tokens of CE(x [N, D] @ embed [V, D]^T, targets [N]) as f32, differentiable in x
  and embed (compute dtype: x.dtype; embed is cast to it)."""
  axes = sharded.split_axes(x.shape[0])
  if not axes:
    return _ce_sum(x, embed, targets, chunk)
  local = lambda *args: jax.lax.psum(_ce_sum(*args, chunk), axes)
  # The table enters the map in the compute dtype, so its gradient is reduced over the devices
  # in that dtype, as every other weight's is (half the bytes of f32), and apart from the
  # embedding lookup's (`_reduced_apart`).
  return _shard_map(local, axes, P())(x, _reduced_apart(embed.astype(x.dtype)), targets)


@jax.custom_vjp
def _reduced_apart(w):
  """The identity; its cotangent passes an optimization barrier.

  The LM head's gradient of the tied table is ready once the loss's forward rule has run; the
  lookup's is the backward's last result. XLA's all-reduce reassociation would add the two and
  reduce the sum once, in f32, after the whole backward (2 H100s, paper shape: a 1.2 ms
  all-reduce at the step's end). The barrier keeps the head's reduction its own: it overlaps
  the backward of the layers outside a scan (XLA keeps no collective in flight across a
  while loop), and each half moves bf16."""
  return w


def _reduced_apart_fwd(w):
  return w, None


def _reduced_apart_bwd(_, g):
  return (jax.lax.optimization_barrier(g),)


_reduced_apart.defvjp(_reduced_apart_fwd, _reduced_apart_bwd)


def _per_token_ce(x, embed, targets, chunk: int = DEFAULT_CHUNK):
  w = embed.astype(x.dtype)
  xs, ts = _chunks(x, targets, chunk)
  ce = jax.lax.map(lambda a: _chunk_terms(a[0], w, a[1])[1], (xs, ts))
  return ce.reshape(-1)[:x.shape[0]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ce_sum(x, embed, targets, chunk: int = DEFAULT_CHUNK):
  return jnp.sum(_per_token_ce(x, embed, targets, chunk))


def _fwd(x, embed, targets, chunk):
  w = embed.astype(x.dtype)
  xs, ts = _chunks(x, targets, chunk)

  def body(carry, blk):
    dw, total = carry
    xc, tc = blk
    logits, ce, valid = _chunk_terms(xc, w, tc)
    # d(sum CE)/d logits = softmax - onehot(target), on valid tokens.
    probs = jnp.exp(logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    onehot = jax.nn.one_hot(tc, logits.shape[1], dtype=_F32)     # all-zero for tc < 0
    dlogits = jnp.where(valid[:, None], probs - onehot, 0.0).astype(x.dtype)
    dx = jnp.dot(dlogits, w, preferred_element_type=_F32).astype(x.dtype)
    dw = dw + jnp.dot(dlogits.T, xc, preferred_element_type=_F32)
    return (dw, total + jnp.sum(ce)), dx

  init = (jnp.zeros(embed.shape, _F32), jnp.zeros((), _F32))
  (dw, total), dx = jax.lax.scan(body, init, (xs, ts))
  return total, (dx.reshape(-1, x.shape[1])[:x.shape[0]], dw, jnp.zeros((), embed.dtype))


def _bwd(chunk, res, g):
  del chunk
  dx, dw, embed_like = res
  return (g * dx.astype(_F32)).astype(dx.dtype), (g * dw).astype(embed_like.dtype), None


_ce_sum.defvjp(_fwd, _bwd)
