r"""Probe: what the forward's dense path for overflowing rows costs, by row count.

    python -m benchmarks.probes.dense_rows [--spec=paper_16k] [--rows=0,1,164,1024,4096,16384]

Times ``dense_rows_mgpu.dense_ffn_rows`` (gather, gate / up GEMM, down GEMM; the row count
read on the device) at each row count against XLA's dense FFN on the spec's whole batch, in
one process: device time (CUPTI) and synchronized wall time. n = 0 is what every forward
without an overflowing row pays.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks.common import specs as specs_lib
from benchmarks.common import timing
from pallas_kernels import dense_rows_mgpu
from pallas_kernels import reference

_SPEC = flags.DEFINE_string("spec", "paper_16k", "benchmarks.common.specs name (shapes).")
_ROWS = flags.DEFINE_list("rows", ["0", "1", "164", "1024", "4096", "16384"], "row counts")
_OUT = flags.DEFINE_string("out", None, "JSON output path")


def main(argv):
  del argv
  spec = specs_lib.get(_SPEC.value)
  m, d, h = spec.m, spec.d, spec.h
  x, wg, wu, wd = spec.inputs()
  dense = jax.jit(lambda *a: reference.dense_ffn_hidden(*a)[0])
  rows_fn = jax.jit(lambda n, *a: dense_rows_mgpu.dense_ffn_rows(
      a[0], jnp.arange(m, dtype=jnp.int32)[::-1], n, *a[1:]))
  args = (x, wg, wu, wd)
  dense_dev = timing.device_ms(dense, *args)
  dense_wall = timing.wall_ms(dense, *args, iters=20)
  print(f"{jax.devices()[0].device_kind}: {_SPEC.value} M={m} D={d} H={h}; XLA dense FFN "
        f"device {dense_dev:.3f} ms, synchronized {dense_wall:.3f} ms", flush=True)
  out = {"spec": _SPEC.value, "device": jax.devices()[0].device_kind,
         "dense_device_ms": dense_dev, "dense_wall_ms": dense_wall, "rows": []}
  for n in map(int, _ROWS.value):
    n_arr = jnp.int32(min(n, m))
    dev = timing.device_ms(rows_fn, n_arr, *args)
    wall = timing.wall_ms(rows_fn, n_arr, *args, iters=20)
    table = timing.kernel_breakdown(rows_fn, n_arr, *args) or []
    kern = {name: t for name, t in table}
    out["rows"].append({"n": n, "device_ms": dev, "wall_ms": wall, "kernels": kern})
    print(f"  n={n:6d}: device {dev:.4f} ms ({dev / dense_dev:.3f} of dense), synchronized "
          f"{wall:.3f} ms; " + ", ".join(f"{k.split('twell_dense_rows_')[-1][:24]} {t:.4f}"
                                        for k, t in kern.items()), flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
