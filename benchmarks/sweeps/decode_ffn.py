r"""The few-row FFN of decoding: the sparse decode kernels (`twell_jax.decode`) against the
dense FFN, by rows and by the union of the features that fire in some row.

    python -m benchmarks.sweeps.decode_ffn --out=decode_ffn.json              # one GPU
    python -m benchmarks.sweeps.decode_ffn --sweep --out=decode_ffn.json      # + the tile sweep
    python -m benchmarks.sweeps.decode_ffn --smoke --out=/tmp/decode_ffn.json # CPU, interpreted

At a decode step the dense FFN reads W_gate, W_up and W_down for M <= 64 rows; the sparse one
W_gate and the W_up and W_down rows of the U features that fire in some row. For each M of
`--rows` and each target union fraction of `--unions` the inputs come from
`twell_jax.testing.ffn_inputs` (each row firing `a H` features with a = 1 - (1 - u)^(1/M),
so that M independent rows fire about u H in all), both FFNs are timed on the device (CUPTI,
all kernels of a call), and the measured union is recorded. `break_even` per M: the largest
measured union fraction at which the sparse FFN is still faster (what `train.generate`'s
`DECODE_UNION_LIMIT` rests on). `--sweep` times tile configurations at two points (M 2 with
~1% of H firing; M 16 with ~10%) and reports the best.

JSON: {"device", "d", "h", "rows": [{"m", "union", "union_fraction", "dense_us", "sparse_us",
"ratio"}], "break_even": {M: fraction}, "sweep": [...]}.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import timing

flags.DEFINE_integer("d", 2048, "model width D (the paper's 0.5B shape)")
flags.DEFINE_integer("h", 5632, "hidden width H")
flags.DEFINE_list("rows", ["2", "4", "16", "64"], "rows M per call")
flags.DEFINE_list("unions", ["0.005", "0.02", "0.05", "0.1", "0.2", "0.35", "0.5", "0.7",
                             "1.0"], "target fractions of H firing in some row")
flags.DEFINE_bool("sweep", False, "also time tile configurations")
flags.DEFINE_bool("smoke", False, "CPU: tiny shapes, the kernels interpreted, no timing")
flags.DEFINE_string("out", None, "write the results as JSON here")


def _inputs(m: int, d: int, h: int, union: float, seed: int):
  from twell_jax import testing  # pylint: disable=import-outside-toplevel
  per_row = 1.0 - (1.0 - min(union, 0.999)) ** (1.0 / m)
  return testing.ffn_inputs(jax.random.key(seed), m, d, h, active_fraction=per_row)


def _time(f, *args, smoke: bool) -> float:
  """Microseconds of one call on the device (CUPTI); the wall clock in the smoke mode."""
  if smoke:
    return timing.wall_ms(f, *args, iters=1) * 1e3
  ms = timing.device_ms(f, *args, iterations=20)
  return (ms if ms is not None else timing.pipelined_ms(f, *args, iters=50)) * 1e3


def measure(m: int, d: int, h: int, union: float, *, smoke: bool, config=None) -> dict:
  from pallas_kernels import decode_ffn_triton  # pylint: disable=import-outside-toplevel
  from twell_jax import decode  # pylint: disable=import-outside-toplevel
  from twell_jax import dense  # pylint: disable=import-outside-toplevel
  x, wg, wu, wd = _inputs(m, d, h, union, seed=m * 1000 + int(union * 997))
  weights = jax.jit(decode.DecodeWeights.of)(wg, wu, wd)
  config = config or decode_ffn_triton.DecodeConfig()
  sparse = jax.jit(lambda x, w: decode.decode_ffn_weights(x, w, interpret=smoke,
                                                          config=config)[0])
  dense_ffn = jax.jit(lambda x, wg, wu, wd: dense.dense_ffn(x, wg, wu, wd, "relu")[0])
  fired = np.asarray(jnp.dot(x, wg) > 0).any(0)
  y_s, y_d = sparse(x, weights), dense_ffn(x, wg, wu, wd)
  err = float(jnp.max(jnp.abs(y_s.astype(jnp.float32) - y_d.astype(jnp.float32))))
  scale = float(jnp.max(jnp.abs(y_d.astype(jnp.float32)))) or 1.0
  row = {"m": m, "union": int(fired.sum()), "union_fraction": float(fired.mean()),
         "max_rel_diff_to_dense": err / scale,
         "dense_us": _time(dense_ffn, x, wg, wu, wd, smoke=smoke),
         "sparse_us": _time(sparse, x, weights, smoke=smoke)}
  row["ratio"] = row["dense_us"] / row["sparse_us"]
  return row


def sweep(d: int, h: int, smoke: bool) -> list[dict]:
  from pallas_kernels import decode_ffn_triton  # pylint: disable=import-outside-toplevel
  base = decode_ffn_triton.DecodeConfig()
  grid = [dict(block_features=bf, block_d=bd, num_warps=w, num_stages=s)
          for bf, bd, w, s in itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (3, 4))]
  grid += [dict(down_features=f, down_cols=c)
           for f, c in itertools.product((64, 128, 256), (64, 128, 256))]
  if smoke:
    grid = grid[:2]
  out = []
  for kw in grid:
    config = dataclasses.replace(base, **kw)
    times = {}
    for m, union in ((2, 0.01), (16, 0.1)):
      try:
        times[m] = measure(m, d, h, union, smoke=smoke, config=config)["sparse_us"]
      except Exception as e:  # pylint: disable=broad-except  # a tile that does not compile
        times[m] = None
        print(f"  {kw}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    out.append({"config": kw, "sparse_us": times})
    print(f"  {kw}: {times}", flush=True)
  return out


def main(argv):
  del argv
  fl = flags.FLAGS
  d, h, rows, unions = fl.d, fl.h, [int(r) for r in fl.rows], [float(u) for u in fl.unions]
  if fl.smoke:
    d, h, rows, unions = 48, 600, [2, 16], [0.02, 0.5]
  kind = jax.devices()[0].device_kind
  result = {"device": kind, "d": d, "h": h, "rows": [], "break_even": {}, "sweep": None}
  for m in rows:
    for u in unions:
      r = measure(m, d, h, u, smoke=fl.smoke)
      result["rows"].append(r)
      print(f"M {m:>2} union {r['union']:>5} ({r['union_fraction']:.3f} of H): dense "
            f"{r['dense_us']:7.1f} us, sparse {r['sparse_us']:7.1f} us ({r['ratio']:.2f}x); "
            f"max diff to dense {r['max_rel_diff_to_dense']:.1e}", flush=True)
    wins = [r["union_fraction"] for r in result["rows"] if r["m"] == m and r["ratio"] > 1]
    result["break_even"][str(m)] = max(wins, default=0.0)
  if fl.sweep:
    result["sweep"] = sweep(d, h, fl.smoke)
  print("break-even union fraction by M:", result["break_even"], flush=True)
  if fl.out:
    with open(fl.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
