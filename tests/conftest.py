"""pytest set-up shared by every test module.

absltest classes read absl flags (create_tempdir, ...); pytest's own argv would
break absl's parser, so parse only the program name here.

`pallas_kernels` is imported first, before any test creates JAX's CPU client, as a user's
`import twell_jax` would: it gives the Mosaic GPU interpreter the XLA CPU threads it needs on
machines with few cores (`pallas_kernels._common.arrange_interpreter_threads`).
"""
import sys

from absl import flags

import pallas_kernels  # noqa: F401

flags.FLAGS(sys.argv[:1], known_only=True)
