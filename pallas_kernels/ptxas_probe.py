"""Compiles each Mosaic GPU kernel of the paper-shape forward / backward once, so that the
plugin's ptxas report (registers, shared memory, spills) can be read from the log.

    MOSAIC_GPU_DUMP_PTXAS=1 python -m pallas_kernels.ptxas_probe 2>&1 | grep -i "registers\\|smem\\|spill\\|Compiling"
"""
import jax

from pallas_kernels import bench_train


def main():
  spec = bench_train.SPECS["paper_16k"]
  res = bench_train.bench_fwd_bwd("paper_16k", iters=1, impls=("mosaic_gpu",), parts=False,
                                  spec=spec)
  print({k: v for k, v in res.items() if k.endswith("_ms")})
  from pallas_kernels import benchmark  # pylint: disable=import-outside-toplevel
  from pallas_kernels import ffn_mgpu  # pylint: disable=import-outside-toplevel
  x, wg, wu, wd = benchmark.make_inputs(benchmark.SPECS["paper_16k"])
  jax.block_until_ready(jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a)[0])(x, wg, wu, wd))


if __name__ == "__main__":
  main()
