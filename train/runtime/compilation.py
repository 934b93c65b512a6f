"""How the trainer's programs compile: the persistent compilation cache and the options of a
train step compiled without autotuning."""

import os

from absl import logging
import jax

# XLA options for a train step compiled without autotuning: GEMMs on cuBLAS's own heuristics
# (Triton GEMMs untuned are several times slower). Autotuning runs candidate kernels on the
# device, which a running training loop keeps busy: a background build with it takes about 5x
# longer than alone (`benchmarks.probes.background_build`).
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def use_compilation_cache(path: str | None, backend: str | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache at `path` (~ expanded) on a GPU, unless
  the cache is already set (`--jax_compilation_cache_dir`); returns the directory in use.
  On the CPU nothing changes (the tests' programs compile in well under a second)."""
  current = jax.config.jax_compilation_cache_dir
  if current or not path or (backend or jax.default_backend()) != "gpu":
    return current or None
  path = os.path.expanduser(path)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  logging.info("compiled programs are cached in %s (config.compilation_cache_dir)", path)
  return path
