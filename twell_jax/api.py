"""`twell_jax.ffn` (module `twell_jax.api`): validation, then an implementation from the registry."""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

from twell_jax import registry
from twell_jax import validation

__all__ = ["ffn", "IMPLEMENTATIONS", "SPARSE_IMPLEMENTATIONS"]

IMPLEMENTATIONS = tuple(registry.IMPLEMENTATIONS)
SPARSE_IMPLEMENTATIONS = registry.SPARSE


def _call(x2, w_gate, w_up, activation, interpret, ell_width, tail_rows,
          hot_features=0) -> registry.Call:
  m, d = x2.shape
  return registry.Call(m=m, d=d, h=w_up.shape[1], gated=w_gate is not None,
                       dtype=jnp.dtype(x2.dtype), activation=activation,
                       interpret=bool(interpret), ell_width=ell_width, tail_rows=tail_rows,
                       hot_features=hot_features)


def ffn(x, w_gate, w_up, w_down, *, activation: str = "relu", implementation: Optional[str] = None,
        interpret: bool = False, return_stats: bool = False, ell_width: int = 128,
        tail_rows: Optional[int] = None, hot_features: int = 0):
  """Feed-forward block y = h W_down with a (sparse) ReLU hidden activation h.

  Gated (w_gate given):  h = act(x W_gate) * (x W_up).   Non-gated (w_gate=None): h = act(x W_up).

  Args:
    x: [..., D] activations (bf16 expected; f16/f32 accepted); leading axes are tokens.
    w_gate: [D, H] or None.  w_up: [D, H].  w_down: [H, D]. Same dtype as x.
    activation: "relu" (exact zeros: sparse implementations), "silu" or "gelu" (dense only).
    implementation: "dense" (plain XLA dense, the baseline), "xla" (the sparse
      algorithm in plain JAX with a sparse custom VJP; runs anywhere),
      "mosaic_gpu" (Pallas Mosaic GPU kernels, Hopper), or None: the fastest
      exact one that supports the call here (mosaic_gpu where supported, else
      dense; `twell_jax.registry.pick`).
    interpret: run Pallas kernels in the Mosaic GPU interpreter (CPU).
    return_stats: also return a `twell_jax.FFNStats`.
    ell_width: W >= 1, ELL slots per row of the sparse implementations' hybrid layout
      (capped at H); the inference forward sends rows with more actives to its dense path
      too.
    tail_rows: R >= 0, static heavy-row capacity of the hybrid layout (None: M/8);
      more heavy rows than R switch to the dense path on device.
    hot_features: K, a multiple of 256: the sparse kernels compute the first K
      hidden features as dense GEMMs (every implementation computes the same
      function). It pays when those are the features that fire on more than
      about 1% of the tokens: sort the features by popularity first
      (`twell_jax.sort_features`, `twell_jax.hot_feature_count`).

  Returns:
    y [..., D] in x.dtype, or (y, FFNStats) with return_stats=True.

  Raises:
    ValueError: a bad argument (`twell_jax.validation`: ranks, shapes, dtypes, activation,
      implementation, ell_width, tail_rows, hot_features, interpret), whichever the
      implementation.
    NotImplementedError: implementation="mosaic_gpu" cannot run this call here, or a
      sparse implementation is asked for forward-mode derivatives (jax.jvp).
  """
  d, _ = validation.ffn_arguments(
      x, w_gate, w_up, w_down, activation=activation, implementation=implementation,
      implementations=IMPLEMENTATIONS, sparse=SPARSE_IMPLEMENTATIONS, interpret=interpret,
      ell_width=ell_width, tail_rows=tail_rows, hot_features=hot_features)
  lead = tuple(x.shape[:-1])
  x2 = x.reshape(math.prod(lead), d)
  call = _call(x2, w_gate, w_up, activation, interpret, ell_width, tail_rows, hot_features)
  if call.m == 0:   # nothing to sparsify; keeps shapes legal for top_k & co.
    y2, st = registry.empty_result(call, x.dtype)
  else:
    impl = registry.pick(call) if implementation is None else registry.get(implementation)
    reason = impl.unsupported(call)
    if reason is not None:
      raise NotImplementedError(f"implementation={impl.name!r} cannot run this call: {reason}.")
    try:
      y2, st = impl.run(call, x2, w_gate, w_up, w_down)
    except TypeError as e:
      # jax.jvp of a jax.custom_vjp function; the sparse implementations define their
      # derivatives in reverse mode only (sparse backward kernels, no tangent kernels).
      if "forward-mode autodiff" not in str(e):
        raise
      raise NotImplementedError(
          f"implementation={impl.name!r} is differentiable in reverse mode only (jax.grad, "
          "jax.vjp, jax.linearize); for forward mode (jax.jvp, jax.jacfwd, jax.hessian) use "
          "implementation='dense', the same function.") from e
  y = y2.reshape(lead + (d,))
  return (y, st) if return_stats else y
