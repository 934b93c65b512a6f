"""NaN and infinities reach the outputs and gradients of every implementation as they reach
the dense FFN's: a sparse path must never make a diverging run look healthy.

Per case (a NaN row and an infinite entry in x; a NaN gate weight; an infinite up weight and
a NaN down weight), the forward's y and the gradients of sum(y * ct) + l1 are non-finite
exactly where the dense implementation's are, and agree with them elsewhere. The kernels run
in the Mosaic GPU interpreter (tiny shapes), the inference forward and the training VJP both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from twell_jax import testing

M, D, H = 128, 64, 256
F32 = jnp.float32


def _inputs():
  x, wg, wu, wd = testing.ffn_inputs(jax.random.key(3), M, D, H, active_fraction=0.05)
  return x, wg, wu, wd


def _poison(case):
  x, wg, wu, wd = _inputs()
  if case == "x":
    x = x.at[5].set(jnp.nan).at[9, 3].set(jnp.inf)
  elif case == "w_gate":
    wg = wg.at[7, 11].set(jnp.nan)
  elif case == "w_up_w_down":
    wu = wu.at[2, 40].set(jnp.inf)
    wd = wd.at[200, 1].set(jnp.nan)
  return x, wg, wu, wd


@functools.cache
def _compiled(impl):
  """impl's jitted forward and gradient, traced once for every case (the interpreted
  kernels' tracing is most of a case's time)."""
  kw = dict(implementation=impl, interpret=impl == "mosaic_gpu")

  def loss(x, wg, wu, wd, ct):
    y, st = tj.ffn(x, wg, wu, wd, return_stats=True, **kw)
    return jnp.sum(y.astype(F32) * ct) + 1e-3 * st.l1

  return (jax.jit(functools.partial(tj.ffn, **kw)),
          jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))))


def _run(impl, args):
  ct = jax.random.normal(jax.random.key(5), (M, D), F32)
  forward, grad = _compiled(impl)
  y = forward(*args)
  grads = grad(*args, ct)
  return [np.asarray(a, np.float32) for a in (y, *grads)]


def _same_nonfinite(got, want, what):
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
  ok = np.isfinite(want)
  scale = max(1.0, float(np.abs(want[ok]).max(initial=0.0)))
  np.testing.assert_allclose(got[ok], want[ok], atol=3e-2 * scale, err_msg=what)


@pytest.mark.parametrize("case", ["x", "w_gate", "w_up_w_down"])
@pytest.mark.parametrize("impl", ["xla", "mosaic_gpu"])
def test_nonfinite_values_propagate_as_in_the_dense_ffn(case, impl):
  args = _poison(case)
  want = _run("dense", args)
  got = _run(impl, args)
  assert not np.isfinite(want[0]).all()          # the case reaches the dense output
  for name, g, w in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), got, want):
    _same_nonfinite(g, w, f"{impl} {case}: {name}")
