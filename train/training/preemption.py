"""Preemption: on SIGTERM, finish the current step, write a checkpoint and stop.

Schedulers announce an eviction with SIGTERM and kill the job with SIGKILL a
grace period later. `Watch` turns the SIGTERM into a request that the training
loop reads once per step (`stop_after(step)`); the loop then saves the state
of that step, waits for the write to commit and raises `Preempted`, which
train.main reports without a traceback. The next run resumes from that
checkpoint: no finished step is lost.

One process: a Python SIGTERM handler sets the request (installed from the
main thread only; a second SIGTERM kills at once, as it would without the
handler). Several processes (jax.distributed): every process must save the
same step, so `stop_after` asks JAX's preemption sync point, whose service
receives the SIGTERM on any host and agrees on the step with the others.
"""

import signal
import threading

from absl import logging
import jax

# What train.main exits with after a preemption: 128 + SIGTERM, what a shell reports for
# a process ended by SIGTERM, so wrappers see that the run did not finish.
EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
  """Training stopped on a SIGTERM after checkpointing `step`."""

  def __init__(self, step: int, saved: bool):
    self.step, self.saved = step, saved
    what = (f"checkpoint of step {step} written" if saved else
            "checkpoints are disabled (checkpoint_every=0), nothing was saved")
    super().__init__(f"preempted (SIGTERM) after step {step}: {what}; rerun the same "
                     "command to resume")


class Watch:
  """Watches for SIGTERM between `install()` and `remove()` (the training loop)."""

  def __init__(self):
    self._requested = threading.Event()
    self._previous = None
    self._multi = jax.process_count() > 1

  def _handler(self, signum, frame):
    del frame
    self._requested.set()
    logging.warning("Received signal %d: stopping after the current step, with a checkpoint",
                    signum)
    # A second SIGTERM ends the process at once.
    signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)

  def install(self) -> "Watch":
    if not self._multi and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handler)
    return self

  def remove(self):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def stop_after(self, step: int) -> bool:
    """Whether to checkpoint `step` and stop (called by every process, every step)."""
    if self._multi:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      return multihost_utils.reached_preemption_sync_point(step)
    return self._requested.is_set()
