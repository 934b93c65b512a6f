"""`twell_jax.ffn` (module `twell_jax.api`): validation, then an implementation from the registry."""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

from twell_jax import dense as dense_lib
from twell_jax import registry
from twell_jax import stats as stats_lib

__all__ = ["ffn", "IMPLEMENTATIONS", "SPARSE_IMPLEMENTATIONS", "default_implementation"]

IMPLEMENTATIONS = tuple(registry.IMPLEMENTATIONS)
SPARSE_IMPLEMENTATIONS = registry.SPARSE
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _check_array(a, name: str, ndim: Optional[int] = None):
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    raise ValueError(f"{name} must be an array; got {type(a).__name__}.")
  if ndim is not None and a.ndim != ndim:
    raise ValueError(f"{name} must have rank {ndim}; got shape {tuple(a.shape)}.")
  if jnp.dtype(a.dtype) not in _FLOAT_DTYPES:
    raise ValueError(f"{name} must have dtype bfloat16, float16 or float32; got {a.dtype}.")


def _validate(x, w_gate, w_up, w_down, activation, implementation):
  """Checks ranks, shapes, dtypes and choices; returns (D, H)."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None; got {implementation!r}.")
  if activation not in dense_lib.ACTIVATIONS:
    raise ValueError(f"activation must be one of {tuple(dense_lib.ACTIVATIONS)}; got {activation!r}.")
  if implementation in SPARSE_IMPLEMENTATIONS and activation != "relu":
    raise ValueError(
        f"activation={activation!r} has no exact zeros, so implementation={implementation!r} "
        "(sparse) cannot run it; use activation='relu' or implementation='dense'.")
  _check_array(x, "x")
  if x.ndim < 1:
    raise ValueError(f"x must have shape [..., D] with rank >= 1; got shape {tuple(x.shape)}.")
  _check_array(w_up, "w_up", 2)
  _check_array(w_down, "w_down", 2)
  d = x.shape[-1]
  h = w_up.shape[1]
  if w_up.shape[0] != d:
    raise ValueError(f"w_up must have shape [D, H] = [{d}, H] to match x [..., {d}]; got {tuple(w_up.shape)}.")
  if w_gate is not None:
    _check_array(w_gate, "w_gate", 2)
    if tuple(w_gate.shape) != (d, h):
      raise ValueError(f"w_gate must have shape [D, H] = {(d, h)} like w_up; got {tuple(w_gate.shape)}.")
  if tuple(w_down.shape) != (h, d):
    raise ValueError(f"w_down must have shape [H, D] = {(h, d)}; got {tuple(w_down.shape)}.")
  for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if w is not None and w.dtype != x.dtype:
      raise ValueError(f"{name} has dtype {w.dtype} but x has {x.dtype}; cast them to one compute dtype.")
  return d, h


def _call(x2, w_gate, w_up, activation, interpret, ell_width, tail_rows,
          hot_features=0) -> registry.Call:
  m, d = x2.shape
  return registry.Call(m=m, d=d, h=w_up.shape[1], gated=w_gate is not None,
                       dtype=jnp.dtype(x2.dtype), activation=activation,
                       interpret=bool(interpret), ell_width=ell_width, tail_rows=tail_rows,
                       hot_features=hot_features)


def default_implementation(x2, w_gate, w_up, w_down, activation: str, interpret: bool = False) -> str:
  """The implementation `implementation=None` picks for x2 [M, D] (`registry.pick`)."""
  del w_down
  return registry.pick(_call(x2, w_gate, w_up, activation, interpret, 128, None)).name


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
      dense; see `default_implementation`).
    interpret: run Pallas kernels in the Mosaic GPU interpreter (CPU).
    return_stats: also return a `twell_jax.FFNStats`.
    ell_width: W, ELL slots per row of the sparse implementations' hybrid layout.
    tail_rows: R, static heavy-row capacity of the hybrid layout
      (None: M/8); more heavy rows than R switch to the dense path on device.
    hot_features: K, a multiple of 256: the sparse kernels compute the first K
      hidden features as dense GEMMs (every implementation computes the same
      function). It pays when those are the features that fire on more than
      about 1% of the tokens: sort the features by popularity first
      (`twell_jax.sort_features`, `twell_jax.hot_feature_count`).

  Returns:
    y [..., D] in x.dtype, or (y, FFNStats) with return_stats=True.

  Raises:
    ValueError: bad ranks, shapes, dtypes, activation or implementation.
    NotImplementedError: implementation="mosaic_gpu" cannot run this call here.
  """
  d, _ = _validate(x, w_gate, w_up, w_down, activation, implementation)
  if (not isinstance(hot_features, int) or hot_features < 0
      or hot_features % stats_lib.TILE_N):
    raise ValueError(f"hot_features must be a non-negative multiple of {stats_lib.TILE_N}; "
                     f"got {hot_features!r}.")
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
    y2, st = impl.run(call, x2, w_gate, w_up, w_down)
  y = y2.reshape(lead + (d,))
  return (y, st) if return_stats else y
