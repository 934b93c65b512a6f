r"""Probe: the few-row decode FFN's kernels with their weights read from memory, by config.

    python -m benchmarks.probes.decode_gate --out=decode_gate.json      # one GPU

At batch 1 the sparse decode FFN (`pallas_kernels.decode_ffn_triton`) reads W_gate whole and
a few rows of W_up and W_down. A micro-benchmark that calls one FFN again and again reads
its 23 MB of W_gate from L2 (50 MB on an H100), which a decode step never does (the model's
other weights pass in between). So each timed call here runs `--layers` FFNs with their own
weights on the same x (paper-like activity: ~`--active` features per row), and the CUPTI
kernel times are reported per layer: the dense FFN, the tiled kernels (`gate_up`, `down`)
and the rows kernel (M <= `--rows_max`) with its partials summed by XLA or by its sum kernel
at a few widths.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks.common import timing

_D = flags.DEFINE_integer("d", 2048, "model width")
_H = flags.DEFINE_integer("h", 5632, "hidden width")
_ROWS = flags.DEFINE_list("rows", ["1", "2", "16"], "rows per call")
_ROWS_MAX = flags.DEFINE_integer("rows_max", 1, "rows up to which the rows kernel is timed")
_ACTIVE = flags.DEFINE_integer("active", 30, "features firing per row")
_LAYERS = flags.DEFINE_integer("layers", 8, "FFNs with their own weights per timed call, so "
                               "that the weights are read from memory, not from L2")
_OUT = flags.DEFINE_string("out", None, "JSON output path")


def _breakdown(label, f, *args, layers: int):
  """Device time of one call per layer (CUPTI), by kernel name summed over the layers."""
  table = timing.kernel_breakdown(f, *args, iterations=10)
  if table is None:
    return None
  total = sum(t for _, t in table) * 1e3 / layers
  by_name: dict[str, float] = {}
  for n, t in table:
    by_name[n] = by_name.get(n, 0.0) + t * 1e3 / layers
  print(f"  {label:<48} {total:8.2f} us/layer  " + ", ".join(
      f"{n[:26]} {t:.2f}" for n, t in by_name.items()), flush=True)
  return {"label": label, "us": total, "kernels": by_name}


def main(argv):
  del argv
  from pallas_kernels import decode_ffn_triton  # pylint: disable=import-outside-toplevel
  from twell_jax import decode  # pylint: disable=import-outside-toplevel
  from twell_jax import dense  # pylint: disable=import-outside-toplevel
  from twell_jax import testing  # pylint: disable=import-outside-toplevel
  d, h, layers = _D.value, _H.value, _LAYERS.value
  print(f"device: {jax.devices()[0].device_kind}; D {d}, H {h}; gate bytes "
        f"{d * h * 2 / 1e6:.1f} MB; {layers} layers per call (weights not in L2)", flush=True)
  out = {"device": jax.devices()[0].device_kind, "d": d, "h": h, "layers": layers, "rows": []}
  for m in (int(r) for r in _ROWS.value):
    per_layer = [testing.ffn_inputs(jax.random.key(100 * m + l), m, d, h,
                                    active_fraction=_ACTIVE.value / h) for l in range(layers)]
    x = per_layer[0][0]
    ws = [w[1:] for w in per_layer]
    dws = [jax.jit(decode.DecodeWeights.of)(*w) for w in ws]
    fired = [int(jnp.sum(jnp.any(jnp.dot(x, w[0]) > 0, axis=0))) for w in ws]
    print(f"M {m}: features firing in some row per layer {fired}", flush=True)
    rec = {"m": m, "fired": fired, "runs": []}
    runs = rec["runs"]

    def sparse(cfg):
      return jax.jit(lambda x, dws: sum(
          decode.decode_ffn_weights(x, w, config=cfg)[0].astype(jnp.float32) for w in dws))
    dense_f = jax.jit(lambda x, ws: sum(
        dense.dense_ffn(x, *w, "relu")[0].astype(jnp.float32) for w in ws))
    want = dense_f(x, ws)
    base = _breakdown("dense FFN", dense_f, x, ws, layers=layers)
    runs.append(base)
    configs = [("tiled kernels", decode_ffn_triton.DecodeConfig(rows_max=0))]
    if m <= _ROWS_MAX.value:
      rows = dict(rows_max=_ROWS_MAX.value, rows_features=8, rows_warps=4)
      configs.append(("rows kernel, XLA sum", decode_ffn_triton.DecodeConfig(**rows, rows_sum="xla")))
      for cols in (8, 32):
        configs.append((f"rows kernel, sum kernel of {cols} columns", decode_ffn_triton.DecodeConfig(
            **rows, rows_sum="kernel", rows_sum_cols=cols)))
      for bf in (4, 16):
        configs.append((f"rows kernel, {bf} features, sum kernel of 8", decode_ffn_triton.DecodeConfig(
            **{**rows, "rows_features": bf}, rows_sum="kernel", rows_sum_cols=8)))
      # The gate GEMV alone (XLA, W_gate^T [H, D]): where a gate computed by XLA would start.
      gemv = jax.jit(lambda x, dws: sum(jnp.sum(jnp.maximum(jax.lax.dot_general(
          x, w.w_pre_t, (((1,), (1,)), ((), ()))), 0).astype(jnp.float32)) for w in dws))
      runs.append(_breakdown("XLA gate GEMV with relu alone", gemv, x, dws, layers=layers))
    for label, cfg in configs:
      try:
        f = sparse(cfg)
        got = f(x, dws)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        r = _breakdown(f"{label} (rel err {err:.2g})", f, x, dws, layers=layers)
        r["config"] = str(cfg)
        if base and r:
          r["ratio"] = base["us"] / r["us"]
          print(f"    ratio to dense {r['ratio']:.3f}", flush=True)
      except Exception as e:  # pylint: disable=broad-except
        print(f"  {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        r = {"label": label, "error": str(e)[:300]}
      runs.append(r)
    out["rows"].append(rec)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
