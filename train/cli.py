"""The commands' shared runner: `run(main, define_flags)`.

Every command (`train.main`, `train.evaluate`, `train.generate`, `train.export_hf`,
`train.import_hf`, `train.report`) parses its absl flags, quiets the libraries' logs and
runs its `main()`; a `ConfigError`, `CheckpointError` or `DataError` (`train.errors`) stops it with one
line, `error: ...` (exit status 1), and a stop on SIGTERM (`preemption.Preempted`, after the
current step's checkpoint) with `stopped: ...` and exit status 143. Anything else is a bug
and keeps its traceback.

Several processes (`train.runtime.distributed`): each tells the others how it ends
(`train.runtime.peer_watch`). An unexpected error first gives the watch time to name a lost
process, the usual cause of a failed collective (its line and exit status 75 replace the
traceback). A process that fails leaves at once, skipping JAX's shutdown barrier, which would
wait for peers that are stopping too.

A command that succeeds, and one process that stops with one line, leave at once too
(`_exit_now`), once the logs and output are flushed: every file the command writes is closed
by then; the interpreter's teardown only made the user wait (JAX destroying its client and
every compiled program) and let a library's thread print after the last line (an orbax writer
failing as the interpreter shut down, after a failed checkpoint write).
"""

import os
import sys
import traceback

from absl import app
from absl import logging
import jax

from train import errors
from train.runtime import peer_watch


def _exit_now(code: int) -> None:
  """Exits with `code` once the logs and output are flushed, without the interpreter's
  teardown: no library thread can print after the command's last line, and JAX's teardown
  (destroying its client and every compiled program) takes seconds on a GPU."""
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def _leave(line: str, code: int, *, failed: bool) -> None:
  """Ends the command with `line` on stderr and exit status `code`: at once, except a process
  of several that stops without failing (preempted), which goes through JAX's shutdown
  barrier with the others."""
  several = peer_watch.end(failed=failed)
  print(line, file=sys.stderr, flush=True)
  if several and not failed:
    sys.exit(code)
  _exit_now(code)


def _leave_done() -> None:
  """Ends a command that succeeded (module docstring); with several processes it returns, and
  the command ends through JAX's shutdown barrier as usual."""
  if jax.distributed.is_initialized():
    return
  jax.effects_barrier()
  _exit_now(0)


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
      _leave(f"error: {e}", 1, failed=True)
    except preemption.Preempted as e:
      logging.warning("%s", e)
      _leave(f"stopped: {e}", preemption.EXIT_CODE, failed=False)
    except Exception:  # pylint: disable=broad-except
      peer_watch.await_lost_process()
      if peer_watch.end(failed=True):
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # pylint: disable=protected-access
      raise
    finally:
      peer_watch.end(failed=False)   # after a success (or SystemExit); else already ended
    _leave_done()

  if define_flags is not None:
    define_flags()
  jax.config.config_with_absl()
  app.run(wrapped)
