r"""The kernels at public model shapes: exact against the f32 reference, and their speed.

    python -m benchmarks.sweeps.shapes --out=shapes.json              # every shape of SHAPES
    python -m benchmarks.sweeps.shapes --names=qwen2_0p5b,llama3_8b

For each (D, H) of a public model's FFN and a token count (several are not multiples of the
kernels' tiles), on inputs from `twell_jax.testing.ffn_inputs` with `--active` features per
token spread uniformly (random weights carry no popularity skew, so no hot features):

  * forward and forward + backward (with the L1 term) of `twell_jax.ffn(implementation=
    "mosaic_gpu")` against the same call with `implementation="dense"`: pipelined ms per call
    (`benchmarks.common.timing.pipelined_ms`), one process, the same inputs; ratio = sparse / dense;
  * `exact`: y and every gradient within bf16 tolerance of `twell_jax.reference_ffn`'s f32
    result (relative Frobenius error below `TOLERANCE`).

`twell_jax.shape_costs.MEASURED` is this table (its H100 rows): `implementation=None` and the
trainer's per-layer choice run the kernels only at shapes where they win.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import twell_jax
from benchmarks.common import timing
from twell_jax.testing import ffn_inputs

F32 = jnp.float32
LAMBDA = 2e-5
# Relative Frobenius error allowed against the f32 reference (bf16 rounding of h, y and the
# gradients' operands); the tests' tolerances (tests/test_ffn.py).
TOLERANCE = {"y": 1.5e-2, "grad": 2.5e-2}


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  d: int
  h: int
  m: int = 8192


# FFN shapes of public models (D, H); "_odd" rows take a token count that no tile divides.
SHAPES = (
    Shape("gpt2_small", 768, 3072),
    Shape("twell_small", 768, 2816),
    Shape("smollm_360m", 960, 2560),
    Shape("qwen2_0p5b", 896, 4864),
    Shape("qwen2_0p5b_odd", 896, 4864, 5000),
    Shape("qwen2_1p5b", 1536, 8960),
    Shape("paper", 2048, 5632),
    Shape("paper_odd", 2048, 5632, 12345),
    Shape("paper_h8k", 2048, 8192),
    Shape("gemma_2b", 2048, 16384),
    Shape("llama32_3b", 3072, 8192),
    Shape("llama3_8b", 4096, 14336),
)
BY_NAME = {s.name: s for s in SHAPES}


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if not np.all(np.isfinite(a)):
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def measure(shape: Shape, active: float, iters: int) -> dict:
  """One row of the table (module docstring)."""
  x, wg, wu, wd = ffn_inputs(jax.random.key(0), shape.m, shape.d, shape.h,
                             active_fraction=active / shape.h)
  ct = jax.random.normal(jax.random.key(1), x.shape, F32)

  def fwd(impl):
    return jax.jit(lambda *a: twell_jax.ffn(*a, implementation=impl))

  def loss(impl):
    def f(x, wg, wu, wd):
      y, st = twell_jax.ffn(x, wg, wu, wd, implementation=impl, return_stats=True)
      return jnp.sum(y.astype(F32) * ct) + LAMBDA * st.l1
    return f

  def ref_loss(x, wg, wu, wd):
    y, l1 = twell_jax.reference_ffn(x, wg, wu, wd)
    return jnp.sum(y * ct) + LAMBDA * l1

  row = {"name": shape.name, "d": shape.d, "h": shape.h, "m": shape.m}
  args = (x, wg, wu, wd)
  grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))
  y = fwd("mosaic_gpu")(*args)
  y_ref = twell_jax.reference_ffn(*(a.astype(F32) for a in args))[0]
  g = grad(loss("mosaic_gpu"))(*args)
  g_ref = grad(ref_loss)(*(a.astype(F32) for a in args))
  row["y_rel_err"] = _rel(y.astype(F32), y_ref)
  row["grad_rel_err"] = max(_rel(a.astype(F32), b) for a, b in zip(g, g_ref))
  row["exact"] = bool(row["y_rel_err"] < TOLERANCE["y"]
                      and row["grad_rel_err"] < TOLERANCE["grad"])
  for mode, make in (("fwd", fwd), ("fwd_bwd", lambda impl: grad(loss(impl)))):
    ms = {impl: timing.pipelined_ms(make(impl), *args, iters=iters)
          for impl in ("dense", "mosaic_gpu")}
    row[f"{mode}_dense_ms"], row[f"{mode}_sparse_ms"] = ms["dense"], ms["mosaic_gpu"]
    row[f"{mode}_ratio"] = ms["mosaic_gpu"] / ms["dense"]
  return row


def run(names, active: float = 30.0, iters: int = 20) -> list[dict]:
  rows = []
  for name in names:
    t0 = time.time()
    try:
      row = measure(BY_NAME[name], active, iters)
    except Exception as e:  # pylint: disable=broad-except  # a failing shape is a result
      row = {"name": name, "d": BY_NAME[name].d, "h": BY_NAME[name].h, "exact": False,
             "error": f"{type(e).__name__}: {str(e)[:500]}"}
    print(f"  {name:<16} D={row['d']:<5} H={row['h']:<6} "
          + (f"fwd {row['fwd_ratio']:.3f} fwd+bwd {row['fwd_bwd_ratio']:.3f} "
             f"err {row['y_rel_err']:.1e} / {row['grad_rel_err']:.1e}" if "error" not in row else row["error"][:200])
          + f" ({time.time() - t0:.0f} s)", flush=True)
    rows.append(row)
  return rows


def main(argv):
  del argv
  fl = flags.FLAGS
  names = [n for n in fl.names.split(",") if n] if fl.names else [s.name for s in SHAPES]
  unknown = [n for n in names if n not in BY_NAME]
  if unknown:
    sys.exit(f"unknown shapes {unknown}; known: {list(BY_NAME)}")
  rows = run(names, fl.active, fl.iters)
  if fl.out:
    with open(fl.out, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "active": fl.active, "shapes": rows},
                f, indent=1)


if __name__ == "__main__":
  flags.DEFINE_string("names", None, "comma-separated shape names (default: all)")
  flags.DEFINE_float("active", 30.0, "active features per token")
  flags.DEFINE_integer("iters", 20, "calls per timing round")
  flags.DEFINE_string("out", None, "write the table as JSON here")
  app.run(main)
