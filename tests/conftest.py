"""pytest set-up shared by every test module.

absltest classes read absl flags (create_tempdir, ...); pytest's own argv would
break absl's parser, so parse only the program name here.
"""
import os
import sys

from absl import flags

# The Mosaic GPU interpreter runs every warpgroup of a CTA as a host thread whose barrier
# waits block one of XLA's CPU worker threads; the pool is sized by the core count, so on a
# 2-core machine three warpgroups can starve it and hang. XLA sizes it from NPROC when set
# (read when the CPU client is created, after this file).
os.environ.setdefault("NPROC", "32")

flags.FLAGS(sys.argv[:1], known_only=True)
