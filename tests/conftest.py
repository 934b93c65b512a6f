"""pytest set-up shared by every test module.

absltest classes read absl flags (create_tempdir, ...); pytest's own argv would
break absl's parser, so parse only the program name here.
"""
import sys

from absl import flags

flags.FLAGS(sys.argv[:1], known_only=True)
