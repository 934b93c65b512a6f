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
           "array", "floating", "hot_features_value", "ffn_shapes", "ffn_arguments"]

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


def floating(a, name: str):
  """Checks that `a` is an array of a floating dtype (any width: callers cast it)."""
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    raise ValueError(f"{name} must be an array; got {type(a).__name__}.")
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise ValueError(f"{name} must have a floating dtype; got {jnp.dtype(a.dtype)} (token ids "
                     "go through an embedding first).")


def hot_features_value(value, name: str = "hot_features") -> int:
  """`value` as a non-negative multiple of the 256-column TwELL tile; ValueError otherwise."""
  k = static_int(value, name, minimum=0)
  if k % TILE_N:
    raise ValueError(f"{name} must be a multiple of {TILE_N} (the TwELL tile); got {k}.")
  return k


def _majority(sizes: Sequence[int]) -> int:
  return max(sizes, key=sizes.count)


def _and(names: Sequence[str]) -> str:
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def ffn_shapes(x, w_gate, w_up, w_down) -> tuple[int, int]:
  """Checks the ranks and shapes of x [..., D], w_gate [D, H] (or None), w_up [D, H] and
  w_down [H, D] (arrays or `jax.ShapeDtypeStruct`s of floating dtypes); returns (D, H).

  A size is what the tensors that have it agree on: the one tensor that disagrees with all
  the others is named in the ValueError; without such a majority the error lists them all.
  """
  array(x, "x")
  if x.ndim < 1:
    raise ValueError(f"x must have shape [..., D] with rank >= 1; got shape {tuple(x.shape)}.")
  weights = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
  if w_gate is None:   # only the gate is optional
    del weights["w_gate"]
  for name, w in weights.items():
    array(w, name, 2)
  shapes = {"x": tuple(int(n) for n in x.shape)}
  shapes.update({name: tuple(int(n) for n in w.shape) for name, w in weights.items()})
  layouts = {"x": "[..., D]", "w_gate": "[D, H]", "w_up": "[D, H]", "w_down": "[H, D]"}
  # Where each tensor holds D and H.
  d_axis = {"x": -1, "w_gate": 0, "w_up": 0, "w_down": 1}
  h_axis = {"w_gate": 1, "w_up": 1, "w_down": 0}
  h_of = {name: shapes[name][h_axis[name]] for name in weights}
  d_of = {name: shapes[name][d_axis[name]] for name in shapes}
  h, d = _majority(list(h_of.values())), _majority(list(d_of.values()))
  expected = {"w_gate": (d, h), "w_up": (d, h), "w_down": (h, d)}
  for size, value, of in (("H", h, h_of), ("D", d, d_of)):
    odd = [name for name, n in of.items() if n != value]
    if len(odd) == 1 and len(of) > 2:
      name = odd[0]
      others = _and([n for n in of if n != name])
      if name == "x":
        raise ValueError(f"x must have shape [..., D] with D = {d} (the D of {others}); "
                         f"got {shapes['x']}.")
      raise ValueError(f"{name} must have shape {layouts[name]} = {expected[name]} "
                       f"({size} = {value} as in {others}); got {shapes[name]}.")
    if odd:
      listed = ", ".join(f"{name} {layouts[name]} = {shapes[name]}" for name in of)
      raise ValueError(f"the arguments disagree on {size}: {listed}.")
  if d < 1 or h < 1:
    raise ValueError(f"x [..., D] and w_up [D, H] must have D >= 1 and H >= 1; got x "
                     f"{shapes['x']}, w_up {shapes['w_up']}.")
  return d, h


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
  d, h = ffn_shapes(x, w_gate, w_up, w_down)
  for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if w is not None and w.dtype != x.dtype:
      raise ValueError(f"{name} has dtype {w.dtype} but x has {x.dtype}; "
                       "cast them to one compute dtype.")
  return d, h
