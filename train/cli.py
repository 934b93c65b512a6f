"""The commands' shared runner: `run(main, define_flags)`.

Every command (`train.main`, `train.evaluate`, `train.generate`, `train.export_hf`,
`train.import_hf`, `train.report`) parses its absl flags, quiets the libraries' logs and
runs its `main()`; a `ConfigError`, `CheckpointError` or `DataError` (`train.errors`) stops it with one
line, `error: ...` (exit status 1), and a stop on SIGTERM (`preemption.Preempted`, after the
current step's checkpoint) with `stopped: ...` and exit status 143. Anything else is a bug
and keeps its traceback.
"""

import sys

from absl import app
from absl import logging
import jax

from train import errors


def run(main, define_flags=None) -> None:
  """Defines the command's flags (`define_flags`, if the module does not at import), then
  runs `main()` under `absl.app` (module docstring)."""
  from train.runtime import metrics  # pylint: disable=import-outside-toplevel
  from train.training import preemption  # pylint: disable=import-outside-toplevel

  def wrapped(argv):
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    metrics.quiet_library_logs()
    try:
      main()
    except (errors.ConfigError, errors.CheckpointError, errors.DataError) as e:
      logging.error("%s", e)
      sys.exit(f"error: {e}")
    except preemption.Preempted as e:
      logging.warning("%s", e)
      print(f"stopped: {e}", file=sys.stderr)
      sys.exit(preemption.EXIT_CODE)

  if define_flags is not None:
    define_flags()
  jax.config.config_with_absl()
  app.run(wrapped)
