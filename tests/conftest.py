"""pytest set-up shared by every test module.

absltest classes read absl flags (create_tempdir, ...); pytest's own argv would
break absl's parser, so parse only the program name here.

`pallas_kernels` is imported first, before any test creates JAX's CPU client, as a user's
`import twell_jax` would: it gives the Mosaic GPU interpreter the XLA CPU threads it needs on
machines with few cores (`pallas_kernels._target.arrange_interpreter_threads`).

Every test process (pytest's workers and the CLI runs the tests start, which inherit the
environment) shares one persistent JAX compilation cache: the same tiny train step is
compiled once per run of the suite rather than once per test (a CLI run of the tiny config:
6.1 s cold, 3.5 s from the cache). Set JAX_COMPILATION_CACHE_DIR to use another directory.
"""
import os
import sys
import tempfile

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"twell_jax_tests_jax_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# pylint: disable=wrong-import-position
from absl import flags

import pallas_kernels  # noqa: F401,E402

flags.FLAGS(sys.argv[:1], known_only=True)
