"""The decode-step attention kernel (pallas_kernels/decode_attention_triton.py) against XLA's
attention over the cache with the new key and value scattered in: first position (no cached
row), ragged positions, the last cache row, multi-head (G = 1) and grouped (G = 4, 8) heads,
a cache length that is not a multiple of the block; interpreted on the CPU, compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention_triton as da


def _inputs(b, t, kh, g, e, seed):
  ks = jax.random.split(jax.random.key(seed), 5)
  n = lambda k, s: (2.0 * jax.random.normal(k, s)).astype(jnp.bfloat16)
  return (n(ks[0], (b, kh * g, e)), n(ks[1], (b, kh, e)), n(ks[2], (b, kh, e)),
          n(ks[3], (b, t, kh, e)), n(ks[4], (b, t, kh, e)))


def _check(b, t, kh, g, e, pos, *, interpret, seed=0, block_t=16):
  q, kn, vn, kc, vc = _inputs(b, t, kh, g, e, seed)
  pos = jnp.asarray(pos, jnp.int32)
  o, kc2, vc2 = jax.jit(lambda *a: da.decode_attention(
      *a, config=da.AttentionConfig(block_t=block_t), interpret=interpret))(
          q, kn, vn, kc, vc, pos)
  rows = jnp.arange(b)
  kr, vr = kc.at[rows, pos].set(kn), vc.at[rows, pos].set(vn)
  ref = jax.nn.dot_product_attention(q[:, None].astype(jnp.float32), kr.astype(jnp.float32),
                                     vr.astype(jnp.float32), key_value_seq_lengths=pos + 1,
                                     implementation="xla")[:, 0]
  # bf16 probabilities and output: a few bf16 steps of values of magnitude ~2.
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ref), atol=0.05, rtol=0.02)
  np.testing.assert_array_equal(np.asarray(kc2), np.asarray(kr))
  np.testing.assert_array_equal(np.asarray(vc2), np.asarray(vr))


@pytest.mark.parametrize("b,t,kh,g,e,pos", [
    (3, 40, 2, 4, 32, [0, 17, 39]),         # first position, ragged, last row
    (2, 37, 4, 1, 16, [36, 5]),             # multi-head; T not a multiple of the block
    (1, 64, 1, 8, 64, [63]),                # one row (G = 8), the whole cache
    (2, 24, 4, 3, 64, [23, 11]),            # G = 3 (the small config's 12 / 4 heads)
])
def test_matches_xla_attention_interpreted(b, t, kh, g, e, pos):
  _check(b, t, kh, g, e, pos, interpret=True)


def test_refuses_heads_it_does_not_run():
  assert "not a multiple" in da.supports(6, 4, 64)
  assert "power of two" in da.supports(8, 2, 48)
  q, kn, vn, kc, vc = _inputs(1, 8, 2, 3, 24, 0)
  with pytest.raises(ValueError, match="power of two"):
    da.decode_attention(q, kn, vn, kc, vc, jnp.zeros((1,), jnp.int32), interpret=True)


@pytest.mark.gpu
def test_matches_xla_attention_on_the_gpu():
  """The paper shape's heads (16 query, 4 key/value, E = 128) at batch 16, cache 384."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  pos = np.random.default_rng(0).integers(0, 384, size=16)
  _check(16, 384, 4, 4, 128, pos, interpret=False, block_t=64)
