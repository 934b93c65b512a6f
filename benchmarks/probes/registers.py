"""Compiles each Mosaic GPU kernel of the paper-shape forward and forward + backward once, so
that the plugin's ptxas report (registers, shared memory, spills) can be read from the log.

    MOSAIC_GPU_DUMP_PTXAS=1 python -m benchmarks.probes.registers 2>&1 | grep -i "registers\\|smem\\|spill\\|Compiling"
"""

import jax

from benchmarks.common import specs as specs_lib
from pallas_kernels import ffn_mgpu


def main():
  spec = specs_lib.get("paper_16k")
  x, wg, wu, wd = spec.inputs()
  jax.block_until_ready(jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a)[0])(x, wg, wu, wd))
  ct = jax.numpy.ones(x.shape, jax.numpy.float32)
  grad = jax.jit(jax.grad(specs_lib.loss_fn("mosaic_gpu", spec), argnums=(0, 1, 2, 3)))
  jax.block_until_ready(grad(x, wg, wu, wd, ct))


if __name__ == "__main__":
  main()
