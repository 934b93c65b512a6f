"""twell_jax.FeedForward (Flax NNX) and its Linen wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import twell_jax as tj
from twell_jax.layers import linen_feed_forward


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("gated", [True, False])
def test_feed_forward_matches_ffn(gated):
  layer = tj.FeedForward(32, 256, gated=gated, implementation="xla", rngs=nnx.Rngs(0))
  assert (layer.w_gate is None) == (not gated)
  assert layer.w_up[...].shape == (32, 256) and layer.w_down[...].shape == (256, 32)
  assert layer.w_up[...].dtype == jnp.float32
  x = jax.random.normal(jax.random.key(1), (2, 5, 32))
  y, st = layer(x, return_stats=True)
  assert y.shape == (2, 5, 32) and y.dtype == jnp.bfloat16
  bf = lambda w: None if w is None else w[...].astype(jnp.bfloat16)
  want = tj.ffn(x.astype(jnp.bfloat16), bf(layer.w_gate), bf(layer.w_up), bf(layer.w_down), implementation="xla")
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
  assert 0 < float(st.nnz_per_token) < 256 and st.fired.shape == (256,)


def test_training_step_with_l1_reduces_activity():
  """A few SGD steps on the L1 term alone shrink l1: the stats gradient reaches the params."""
  layer = tj.FeedForward(16, 256, implementation="xla", dtype=jnp.float32, rngs=nnx.Rngs(2))
  x = jax.random.normal(jax.random.key(3), (64, 16))

  def loss(model):
    _, st = model(x, return_stats=True)
    return st.l1

  l1_start = float(loss(layer))
  for _ in range(5):
    grads = nnx.grad(loss)(layer)
    nnx.update(layer, jax.tree.map(lambda p, g: p - 0.05 * g, nnx.state(layer, nnx.Param), grads))
  assert float(loss(layer)) < 0.9 * l1_start


def test_dense_silu_baseline_and_bad_combination():
  layer = tj.FeedForward(8, 64, activation="silu", implementation="dense", rngs=nnx.Rngs(0))
  _, st = layer(jnp.ones((3, 8)), return_stats=True)
  assert float(st.nnz_per_token) == 64.0
  with pytest.raises(ValueError, match="sparse"):
    tj.FeedForward(8, 64, activation="silu", implementation="xla", rngs=nnx.Rngs(0))


def test_usable_from_linen():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      y, st = linen_feed_forward(16, 256, name="mlp")(x, return_stats=True)
      return x + y.astype(x.dtype), st.l1

  block = Block()
  x = jax.random.normal(jax.random.key(4), (4, 16))
  variables = block.init(jax.random.key(5), x)
  params = variables["params"]["mlp"]
  assert set(params) == {"w_gate", "w_up", "w_down"} and params["w_up"].shape == (16, 256)
  out, l1 = block.apply(variables, x)
  assert out.shape == (4, 16) and float(l1) > 0
  grads = jax.grad(lambda v: block.apply(v, x)[1])(variables)["params"]["mlp"]
  assert float(jnp.abs(grads["w_gate"]).sum()) > 0
  # Same numbers as the NNX layer holding the same weights.
  bf = lambda w: w.astype(jnp.bfloat16)
  y_ffn = tj.ffn(x.astype(jnp.bfloat16), bf(params["w_gate"]), bf(params["w_up"]), bf(params["w_down"]))
  assert _rel(out - x, y_ffn.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("kwargs,match", [
    (dict(ell_width=0), "ell_width must be a Python int >= 1"),
    (dict(tail_rows=-2), "tail_rows must be a Python int >= 0"),
    (dict(interpret=None), "interpret must be True or False"),
    (dict(implementation="cuda"), "implementation must be one of"),
    (dict(activation="tanh"), "activation must be one of"),
])
def test_bad_layer_option_fails_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tj.FeedForward(8, 256, rngs=nnx.Rngs(0), **kwargs)
  with pytest.raises(ValueError, match="d_ff must be a Python int >= 1"):
    tj.FeedForward(8, 0, rngs=nnx.Rngs(0))
