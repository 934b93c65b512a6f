"""Per-kernel device time of the inference forward with and without its statistics.

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m pallas_kernels.stats_probe

Shows which kernels the statistics (l1, nnz, max tile count, overflow rows, ``fired``) add
to ``ffn_mgpu.ffn_forward`` at the paper shape (the benchmark's "+stats" column).
"""

from __future__ import annotations

import jax

from pallas_kernels import benchmark
from pallas_kernels import common
from pallas_kernels import ffn_mgpu


def main():
  print("device:", jax.devices()[0].device_kind)
  x, wg, wu, wd = benchmark.make_inputs(benchmark.SPECS["paper_16k"])
  variants = {
      "forward, y only": jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a)[0]),
      "forward, y + stats": jax.jit(ffn_mgpu.ffn_forward),
      "forward, y + stats without fired": jax.jit(
          lambda *a: (lambda y, st: (y, {k: v for k, v in st.items() if k != "fired"}))(
              *ffn_mgpu.ffn_forward(*a))),
  }
  for label, f in variants.items():
    ms, _, _ = common.time_fn(f, x, wg, wu, wd, iters=30, kernel_time=False)
    print(f"{label}: {ms:.3f} ms wall")
    common.print_breakdown(label, common.kernel_breakdown(f, x, wg, wu, wd))


if __name__ == "__main__":
  main()
