r"""What a jitted call pays beyond its kernels on this GPU: an XLA conditional's host round trip.

    python -m pallas_kernels.overhead_probe

Times the same chain of six [16384, 2048] x [2048, 2048] bf16 GEMMs three ways: plain; with
the last three inside a ``lax.cond`` whose predicate is computed on the device; with the last
three inside a ``lax.switch`` of 3 branches. Reports the synchronized and the pipelined
(back-to-back calls, one sync) wall time per call and the summed kernel time (CUPTI), so the
difference shows the launch gaps a conditional adds. Run it under different ``XLA_FLAGS``
(e.g. ``--xla_gpu_enable_command_buffer=``) to compare XLA's conditional implementations.
"""

from __future__ import annotations

import os

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import common


def _chain(a, w, n):
  for _ in range(n):
    a = a @ w
  return a


def main():
  print("device:", jax.devices()[0].device_kind, "XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""))
  ka, kw = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (16384, 2048), jnp.bfloat16)
  w = (jax.random.normal(kw, (2048, 2048), jnp.float32) / 45.0).astype(jnp.bfloat16)

  plain = jax.jit(lambda a, w: _chain(_chain(a, w, 3), w, 3))

  def with_cond(a, w):
    b = _chain(a, w, 3)
    return lax.cond(jnp.sum(b[0].astype(jnp.float32)) > -1e30,
                    lambda: _chain(b, w, 3), lambda: b)

  def with_switch(a, w):
    b = _chain(a, w, 3)
    i = jnp.where(jnp.sum(b[0].astype(jnp.float32)) > -1e30, 0, 1)
    return lax.switch(i, [lambda: _chain(b, w, 3), lambda: b, lambda: b * 2])

  for name, f in (("plain", plain), ("cond", jax.jit(with_cond)),
                  ("switch", jax.jit(with_switch))):
    sync, _, _ = common.time_fn(f, a, w, iters=30, kernel_time=False)
    pipe = common.pipelined_ms(f, a, w, iters=30)
    table = common.kernel_breakdown(f, a, w) or []
    ksum = sum(t for _, t in table)
    print(f"{name:8s} sync {sync:.4f} ms  pipelined {pipe:.4f} ms  kernels {ksum:.4f} ms "
          f"({len(table)} launches)", flush=True)


if __name__ == "__main__":
  main()
