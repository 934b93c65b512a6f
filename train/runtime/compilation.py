"""How the trainer's programs compile: the persistent compilation cache, the options of a
step compiled without autotuning, and the interpreter settings while one compiles beside a
running training loop."""

import concurrent.futures
import contextlib
import gc
import os
import sys
import threading

from absl import logging
import jax

# XLA options for a train step compiled without autotuning: GEMMs on cuBLAS's own heuristics
# (Triton GEMMs untuned are several times slower). Autotuning runs candidate kernels on the
# device, which a running training loop keeps busy: a background build with it takes about 5x
# longer than alone (`benchmarks.probes.background_build`).
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}

# Tracing and lowering are Python work that holds the GIL; the training loop must not wait
# behind them to dispatch its steps (the device would idle). With the default 5 ms switch
# interval, a compile beside training cost the paper 0.5B shape's loop 4-8 s per evaluation
# step compiled (H200); the cyclic collector's full collections over the many objects a
# compile creates stop every thread too.
_SWITCH_INTERVAL_S = 2e-4
_beside_lock = threading.Lock()
_beside = {"compiles": 0, "interval": None, "collecting": None}


@contextlib.contextmanager
def beside_training():
  """While any thread is inside: the interpreter's switch interval shortened to 0.2 ms and
  the cyclic garbage collector off. Every compile on a worker thread beside training runs
  inside; the settings come back when the last one leaves."""
  with _beside_lock:
    if _beside["compiles"] == 0:
      _beside["interval"], _beside["collecting"] = sys.getswitchinterval(), gc.isenabled()
      sys.setswitchinterval(min(_beside["interval"], _SWITCH_INTERVAL_S))
      gc.disable()
    _beside["compiles"] += 1
  try:
    yield
  finally:
    with _beside_lock:
      _beside["compiles"] -= 1
      if _beside["compiles"] == 0:
        sys.setswitchinterval(_beside["interval"])
        if _beside["collecting"]:
          gc.enable()


def on_worker_thread(fn) -> concurrent.futures.Future:
  """`fn()` started on a new worker thread; its future (the thread ends with `fn`)."""
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  future = pool.submit(fn)
  pool.shutdown(wait=False)
  return future


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
