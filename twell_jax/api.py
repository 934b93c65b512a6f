"""`twell_jax.ffn` (module `twell_jax.api`): validation, then an implementation from the registry."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
from jax.interpreters import ad
import jax.numpy as jnp

from twell_jax import registry
from twell_jax import validation

__all__ = ["ffn", "resolve_implementation", "IMPLEMENTATIONS", "SPARSE_IMPLEMENTATIONS"]

IMPLEMENTATIONS = tuple(registry.IMPLEMENTATIONS)
SPARSE_IMPLEMENTATIONS = registry.SPARSE


def _call(x, w_gate, w_up, activation, interpret, ell_width, tail_rows, hot_features,
          device=None) -> registry.Call:
  return registry.Call(m=math.prod(x.shape[:-1]), d=x.shape[-1], h=w_up.shape[1],
                       gated=w_gate is not None, dtype=jnp.dtype(x.dtype),
                       activation=activation, interpret=bool(interpret), ell_width=ell_width,
                       tail_rows=tail_rows, hot_features=hot_features, device=device)


def resolve_implementation(x, w_gate, w_up, w_down, *, activation: str = "relu",
                           implementation: Optional[str] = None, interpret: bool = False,
                           ell_width: int = 128, tail_rows: Optional[int] = None,
                           hot_features: int = 0, device=None) -> str:
  """The name of the implementation `twell_jax.ffn` runs for these arguments.

  Takes `ffn`'s arguments (arrays, or `jax.ShapeDtypeStruct`s: only shapes and dtypes
  matter) and makes its checks: the same ValueError for a bad argument, and the same
  NotImplementedError for a named implementation that cannot run the call. With
  implementation=None the answer is the automatic choice (`twell_jax.registry.pick`):
  "mosaic_gpu" where the kernels run (a Hopper GPU with bfloat16, or interpret=True) and
  were measured faster than dense at this shape, else "dense". `device`: the device to
  answer for (default: where JAX runs a call whose inputs are not committed to a device,
  `jax.default_device` or the first device). Under a mesh, `twell_jax.sharded.ffn` and
  `FeedForward` make the choice per device, on its share of the tokens;
  `FFNStats.implementation` says what ran.
  """
  validation.ffn_arguments(
      x, w_gate, w_up, w_down, activation=activation, implementation=implementation,
      implementations=IMPLEMENTATIONS, sparse=SPARSE_IMPLEMENTATIONS, interpret=interpret,
      ell_width=ell_width, tail_rows=tail_rows, hot_features=hot_features)
  return _resolve(_call(x, w_gate, w_up, activation, interpret, ell_width, tail_rows,
                        hot_features, device), implementation).name


def _resolve(call: registry.Call, implementation: Optional[str]):
  """The implementation that runs `call` (validated), or NotImplementedError saying why the
  named one cannot."""
  if implementation is None:
    return registry.pick(call)
  impl = registry.get(implementation)
  reason = impl.unsupported(call) if call.m else None   # no tokens: nothing runs
  if reason is not None:
    raise NotImplementedError(f"implementation={impl.name!r} cannot run this call: {reason}.")
  return impl


def _refuse_forward_mode(name: str, operands) -> None:
  """NotImplementedError when a sparse implementation is traced for forward-mode autodiff.

  Their `jax.custom_vjp` defines reverse-mode derivatives only (sparse backward kernels, no
  tangent kernels). JAX itself fails only where the tangent is evaluated: at once outside
  jit, at compile time inside it, with a message that names no FFN. A JVP tracer is seen
  here, at trace time, when the forward-mode transform wraps this call; reverse mode traces
  with linearize tracers instead (`jax_use_direct_linearize`, the default), so the check
  is skipped when that is off. (Forward mode applied to an already traced function, say
  `jax.jvp` of a `jax.jit` of it, reaches JAX's own TypeError.)
  """
  if name not in SPARSE_IMPLEMENTATIONS or not jax.config.jax_use_direct_linearize:
    return
  if any(isinstance(a, ad.JVPTracer) for a in operands):
    raise NotImplementedError(
        f"implementation={name!r} is differentiable in reverse mode only (jax.grad, "
        "jax.vjp, jax.linearize); for forward mode (jax.jvp, jax.jacfwd, jax.hessian) use "
        "implementation='dense', the same function.")


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
      dense; `resolve_implementation` answers which, `FFNStats.implementation` says
      which ran).
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
      sparse implementation is traced for forward-mode derivatives (jax.jvp, jax.jacfwd).
  """
  d, _ = validation.ffn_arguments(
      x, w_gate, w_up, w_down, activation=activation, implementation=implementation,
      implementations=IMPLEMENTATIONS, sparse=SPARSE_IMPLEMENTATIONS, interpret=interpret,
      ell_width=ell_width, tail_rows=tail_rows, hot_features=hot_features)
  lead = tuple(x.shape[:-1])
  x2 = x.reshape(math.prod(lead), d)
  call = _call(x2, w_gate, w_up, activation, interpret, ell_width, tail_rows, hot_features)
  impl = _resolve(call, implementation)
  if call.m == 0:   # nothing to sparsify; keeps shapes legal for top_k & co.
    y2, st = registry.empty_result(call, x.dtype)
  else:
    _refuse_forward_mode(impl.name, (x2, w_gate, w_up, w_down))
    y2, st = impl.run(call, x2, w_gate, w_up, w_down)
  st = dataclasses.replace(st, implementation=impl.name)
  y = y2.reshape(lead + (d,))
  return (y, st) if return_stats else y
