"""Argument checks shared by `twell_jax.ffn`, `twell_jax.FeedForward` and the layouts.

Every implementation receives its arguments through `ffn_arguments`, so a bad
value gets the same `ValueError` whichever implementation was asked for (or
none), before any implementation runs: the message names the argument, the
allowed range and the value received. Static sizes (`ell_width`, `tail_rows`,
tile widths) must be Python integers: they fix array shapes at trace time.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from twell_jax import dense as dense_lib
from pallas_kernels._common import TILE_N

__all__ = ["FLOAT_DTYPES", "static_int", "flag", "implementation_choice", "activation_choice",
           "array", "hot_feature_count", "ffn_arguments"]

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def static_int(value, name: str, *, minimum: int, allow_none: bool = False,
               none_means: str = "") -> Optional[int]:
  """`value` as an int >= `minimum` (or None where allowed); ValueError otherwise."""
  if value is None and allow_none:
    return None
  allowed = f"a Python int >= {minimum}" + (f", or None ({none_means})" if allow_none else "")
  if isinstance(value, (bool, jax.Array)) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{name} must be {allowed}; got {value!r} ({type(value).__name__}).")
  if value < minimum:
    raise ValueError(f"{name} must be {allowed}; got {value!r}.")
  return int(value)


def flag(value, name: str) -> bool:
  """`value` as a bool (Python or numpy); ValueError for anything else."""
  if not isinstance(value, (bool, jnp.bool_)):
    raise ValueError(f"{name} must be True or False; got {value!r}.")
  return bool(value)


def implementation_choice(value, implementations: Sequence[str]) -> Optional[str]:
  """Checks an implementation name (None: the automatic choice)."""
  if value is not None and value not in implementations:
    raise ValueError(f"implementation must be one of {tuple(implementations)} or None; "
                     f"got {value!r}.")
  return value


def activation_choice(value, implementation: Optional[str], sparse: Sequence[str]) -> str:
  """Checks the activation name and that a sparse implementation gets exact zeros."""
  if value not in dense_lib.ACTIVATIONS:
    raise ValueError(f"activation must be one of {tuple(dense_lib.ACTIVATIONS)}; got {value!r}.")
  if implementation in sparse and value != "relu":
    raise ValueError(
        f"activation={value!r} has no exact zeros, so implementation={implementation!r} "
        "(sparse) cannot run it; use activation='relu' or implementation='dense'.")
  return value


def array(a, name: str, ndim: Optional[int] = None):
  """Checks that `a` is a floating array (bf16, f16 or f32) of rank `ndim`."""
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    raise ValueError(f"{name} must be an array; got {type(a).__name__}.")
  if ndim is not None and a.ndim != ndim:
    raise ValueError(f"{name} must have rank {ndim}; got shape {tuple(a.shape)}.")
  if jnp.dtype(a.dtype) not in FLOAT_DTYPES:
    raise ValueError(f"{name} must have dtype bfloat16, float16 or float32; got {a.dtype}.")


def hot_features_value(value, name: str = "hot_features") -> int:
  """`value` as a non-negative multiple of the 256-column TwELL tile; ValueError otherwise."""
  k = static_int(value, name, minimum=0)
  if k % TILE_N:
    raise ValueError(f"{name} must be a multiple of {TILE_N} (the TwELL tile); got {k}.")
  return k


def ffn_arguments(x, w_gate, w_up, w_down, *, activation: str, implementation,
                  implementations: Sequence[str], sparse: Sequence[str], interpret,
                  ell_width, tail_rows, hot_features=0) -> tuple[int, int]:
  """Checks every argument of `twell_jax.ffn`; returns (D, H)."""
  implementation_choice(implementation, implementations)
  activation_choice(activation, implementation, sparse)
  flag(interpret, "interpret")
  static_int(ell_width, "ell_width", minimum=1)
  static_int(tail_rows, "tail_rows", minimum=0, allow_none=True, none_means="M/8")
  hot_features_value(hot_features)
  array(x, "x")
  if x.ndim < 1:
    raise ValueError(f"x must have shape [..., D] with rank >= 1; got shape {tuple(x.shape)}.")
  array(w_up, "w_up", 2)
  array(w_down, "w_down", 2)
  d = x.shape[-1]
  h = w_up.shape[1]
  if d < 1 or h < 1:
    raise ValueError(f"x [..., D] and w_up [D, H] must have D >= 1 and H >= 1; got x "
                     f"{tuple(x.shape)}, w_up {tuple(w_up.shape)}.")
  if w_up.shape[0] != d:
    raise ValueError(f"w_up must have shape [D, H] = [{d}, H] to match x [..., {d}]; "
                     f"got {tuple(w_up.shape)}.")
  if w_gate is not None:
    array(w_gate, "w_gate", 2)
    if tuple(w_gate.shape) != (d, h):
      raise ValueError(f"w_gate must have shape [D, H] = {(d, h)} like w_up; "
                       f"got {tuple(w_gate.shape)}.")
  if tuple(w_down.shape) != (h, d):
    raise ValueError(f"w_down must have shape [H, D] = {(h, d)}; got {tuple(w_down.shape)}.")
  for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if w is not None and w.dtype != x.dtype:
      raise ValueError(f"{name} has dtype {w.dtype} but x has {x.dtype}; "
                       "cast them to one compute dtype.")
  return d, h
