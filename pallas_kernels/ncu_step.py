r"""The training step (forward + backward) at a benchmark shape, run a few times, as a target
for Nsight Compute: where the gather kernels' warps stall, their occupancy and L2 / DRAM
traffic. On the device machine (Firecracker runtime; leave the clocks alone):

    ncu --clock-control none --kernel-name regex:twell_ --launch-skip 5 --launch-count 5 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 -m pallas_kernels.ncu_step [spec] [k=v ...]

``spec``: a ``bench_train.SPECS`` name (default paper_16k); ``k=v``: TrainConfig fields
(ints, or "a,b" tuples for ``rows_ahead``). The first call compiles; each call launches the
five twell_ kernels (gate + pack, up / down, column dh + dW_down, dW_up / dW_gate, dx).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from pallas_kernels import bench_train
from pallas_kernels import ffn_train_mgpu
from twell_jax.testing import ffn_inputs


def _parse(kv: str):
  k, v = kv.split("=", 1)
  if k == "rows_ahead":
    return k, tuple(s for s in v.split(",") if s)
  return k, int(v)


def main(argv):
  spec = bench_train.SPECS[argv[1] if len(argv) > 1 and "=" not in argv[1] else "paper_16k"]
  kw = dict(_parse(a) for a in argv[1:] if "=" in a)
  x, wg, wu, wd = ffn_inputs(jax.random.key(0), spec.m, spec.d, spec.h,
                             active_fraction=spec.active / spec.h)
  cfg = ffn_train_mgpu.make_config(spec.m, spec.d, spec.h, spec.ell_width, spec.tail_rows, **kw)
  dy = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)

  @jax.jit
  def step(x_, wg_, wu_, wd_):
    out, res = ffn_train_mgpu.forward(cfg, x_, wg_, wu_, wd_)
    return out[0], ffn_train_mgpu.backward(cfg, res, (dy, jnp.float32(2e-5)))

  for _ in range(3):
    jax.block_until_ready(step(x, wg, wu, wd))
  print("ncu_step: done", cfg, flush=True)


if __name__ == "__main__":
  main(sys.argv)
