"""Ends every process of a multi-process run promptly when one of them is lost or fails.

Why a watch of our own: jax 0.11.2's runtime notices a dead process only when its heartbeats
have been missing for `heartbeat_timeout_seconds` (100 s by default), and then aborts every
other process with a C++ fatal error and a stack trace; a Python `missed_heartbeat_callback`
cannot replace that (the runtime's status does not convert to Python: std::bad_cast, then
abort). Meanwhile a process blocked in an NCCL collective waits for the dead one forever.

`PeerWatch` is a daemon thread in every process that beats through the coordination
service's key-value store (the service runs inside process 0), under `PREFIX`:

  beat/<i>    process i's counter, bumped every `interval_s`;
  done/<i>    process i ended normally (or was preempted): it is never judged again;
  failed/<i>  process i stopped with an error of its own;
  erring/<i>  process i hit an error and waits for a verdict (a lost peer may be its cause);
  lost        the first verdict on a lost process, "<lost> <seconds silent> <seen by>".

Each check reads the whole directory. A peer whose counter has not moved for `timeout_s`
(as this process's clock sees it) is lost: the first process to notice publishes `lost`, and
every process prints one line naming it and exits with `LOST_EXIT_CODE`. A peer marked failed
ends the others with exit status 1 and a line naming it. If the service itself stops
answering, process 0, which hosts it, is gone. Between checks the thread waits on the `lost`
key (a blocking get with an `interval_s` deadline), so a published verdict reaches every
process at once, and a vanished service is seen at once.

Cost: one write and one directory read per process and interval: fine for tens of hosts.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Callable

PREFIX = "twell/peers/"
# EX_TEMPFAIL: a temporary failure; rerunning the job resumes from its last checkpoint.
LOST_EXIT_CODE = 75
FAILED_EXIT_CODE = 1


@dataclasses.dataclass(frozen=True)
class Verdict:
  """Why this process must stop: `line` to print, `code` to exit with."""
  line: str
  code: int


def lost_line(lost: int, count: int, me: int, silent_s: float, seen_by: int) -> str:
  who = f"process {lost} of {count}" + (", the coordinator," if lost == 0 else "")
  seen = "" if seen_by == me else f" (seen by process {seen_by})"
  return (f"error: lost {who} silent for {silent_s:.0f} s{seen}: killed, crashed or its host "
          f"is gone; process {me} stops too (exit {LOST_EXIT_CODE}). Rerun the job: it resumes "
          "from its last committed checkpoint.")


def coordinator_gone_line(count: int, me: int, cause: str) -> str:
  return (f"error: lost process 0 of {count}, the coordinator: its coordination service stopped "
          f"answering ({cause}); process {me} stops too (exit {LOST_EXIT_CODE}). Rerun the job: "
          "it resumes from its last committed checkpoint.")


def failed_line(failed: int, count: int, me: int) -> str:
  return (f"error: process {failed} of {count} stopped with an error (see its log); process {me} "
          f"stops too (exit {FAILED_EXIT_CODE}).")


def _is_deadline(e: Exception) -> bool:
  """Whether a key-value call ended by its own deadline (the key is just not there yet)."""
  return "DEADLINE_EXCEEDED" in str(e)


def _first_line(e: Exception) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def exit_with(verdict: Verdict) -> None:
  """Prints the verdict's line and ends the process at once: nothing may wait on a peer."""
  sys.stdout.flush()
  print(verdict.line, file=sys.stderr, flush=True)
  os._exit(verdict.code)  # pylint: disable=protected-access


class PeerWatch:
  """The watch of one process (module docstring). `client` is jax's distributed runtime
  client (or anything with its key-value methods); `act` receives the verdict (default: print
  it and exit); `clock` is monotonic seconds."""

  def __init__(self, client, index: int, count: int, *, timeout_s: float = 20.0,
               interval_s: float = 1.0, act: Callable[[Verdict], None] = exit_with,
               clock: Callable[[], float] = time.monotonic):
    if timeout_s <= interval_s:
      raise ValueError(f"timeout_s={timeout_s} must exceed interval_s={interval_s}")
    self.client, self.index, self.count = client, index, count
    self.timeout_s, self.interval_s = timeout_s, interval_s
    self._act, self._clock = act, clock
    self._beats = 0
    start = clock()
    # peer -> (its last counter seen, when it was first seen at that value).
    self._seen: dict[int, tuple[str | None, float]] = {
        p: (None, start) for p in range(count) if p != index}
    self._lock = threading.Lock()
    self._stopped = False
    self._verdict = threading.Event()
    self._thread = None

  def start(self) -> "PeerWatch":
    self._thread = threading.Thread(target=self._run, name="twell-peer-watch", daemon=True)
    self._thread.start()
    return self

  def _run(self) -> None:
    while not self._stopped:
      verdict = self.check()
      if verdict is None:
        verdict = self.wait()
      if verdict is not None:
        self._decide(verdict)
        return

  def check(self) -> Verdict | None:
    """One beat and one look at every peer: the verdict, or None while all is well."""
    self._beats += 1
    try:
      self.client.key_value_set(f"{PREFIX}beat/{self.index}", str(self._beats),
                                allow_overwrite=True)
      entries = dict(self.client.key_value_dir_get(PREFIX))
    except Exception as e:  # pylint: disable=broad-except
      return Verdict(coordinator_gone_line(self.count, self.index, _first_line(e)),
                     LOST_EXIT_CODE)
    entries = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in entries.items()}
    if "lost" in entries:
      return self._published(entries["lost"])
    now = self._clock()
    silent = []
    for p, (value, since) in self._seen.items():
      if f"done/{p}" in entries:
        continue
      if f"failed/{p}" in entries:
        return Verdict(failed_line(p, self.count, self.index), FAILED_EXIT_CODE)
      beat = entries.get(f"beat/{p}")
      if beat != value:
        self._seen[p] = (beat, now)
      elif now - since > self.timeout_s:
        silent.append((now - since, p))
    if not silent:
      return None
    silent_s, lost = max(silent)
    try:  # The first verdict stands: every process reports the same lost process.
      self.client.key_value_set(f"{PREFIX}lost", f"{lost} {silent_s:.1f} {self.index}")
    except Exception:  # pylint: disable=broad-except
      pass
    return Verdict(lost_line(lost, self.count, self.index, silent_s, self.index), LOST_EXIT_CODE)

  def wait(self) -> Verdict | None:
    """Waits `interval_s` on the verdict key: a published verdict, a vanished service, or
    None."""
    try:
      value = self.client.blocking_key_value_get(f"{PREFIX}lost", int(self.interval_s * 1000))
    except Exception as e:  # pylint: disable=broad-except
      if _is_deadline(e):
        return None
      return Verdict(coordinator_gone_line(self.count, self.index, _first_line(e)),
                     LOST_EXIT_CODE)
    return self._published(value)

  def _published(self, value: str) -> Verdict:
    lost, silent_s, seen_by = value.split()
    return Verdict(lost_line(int(lost), self.count, self.index, float(silent_s), int(seen_by)),
                   LOST_EXIT_CODE)

  def _decide(self, verdict: Verdict) -> None:
    with self._lock:
      if self._stopped:
        return
      self._verdict.set()
      if self.index == 0 and verdict.code == LOST_EXIT_CODE:
        # The service lives in this process: let the verdict reach the others before it goes.
        time.sleep(self.interval_s)
      self._act(verdict)

  def await_verdict(self, timeout_s: float | None = None) -> bool:
    """After an error of this process: waits (up to `timeout_s`, default long enough to judge
    a peer that just went silent) for a verdict; with the default `act` a verdict ends the
    process. Returns whether one came; it returns early when every peer has ended or hit an
    error too (none of them is lost: the same error everywhere, say)."""
    try:
      self.client.key_value_set(f"{PREFIX}erring/{self.index}", "1", allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass
    deadline = self._clock() + (self.timeout_s + 3 * self.interval_s
                                if timeout_s is None else timeout_s)
    while self._clock() < deadline and not self._stopped:
      if self._verdict.wait(self.interval_s / 4):
        return True
      if self._all_peers_ended():
        return False
    return self._verdict.is_set()

  def _all_peers_ended(self) -> bool:
    try:
      keys = {k for k, _ in self.client.key_value_dir_get(PREFIX)}
    except Exception:  # pylint: disable=broad-except
      return False
    return all(any(f"{PREFIX}{kind}/{p}" in keys for kind in ("done", "failed", "erring"))
               for p in self._seen)

  def stop(self, *, failed: bool) -> None:
    """Stops judging and tells the peers how this process ends (`failed`: with an error of
    its own, which stops them too). Blocks while a verdict is being acted on."""
    with self._lock:
      if self._stopped:
        return
      self._stopped = True
    if self._thread is not None and self._thread is not threading.current_thread():
      # Not left inside a runtime call: a daemon thread in C++ code aborts the interpreter's
      # exit ("FATAL: exception not rethrown").
      self._thread.join(timeout=5 * self.interval_s)
    try:
      self.client.key_value_set(f"{PREFIX}{'failed' if failed else 'done'}/{self.index}", "1",
                                allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      return
    if failed and self.index == 0:
      # The service lives in this process: let the others read the marker before it goes.
      time.sleep(2 * self.interval_s)


# The watch of this process, while one runs (`start`).
_ACTIVE: PeerWatch | None = None


def start(client, index: int, count: int, *, timeout_s: float) -> PeerWatch:
  """Starts this process's watch (`train.runtime.distributed` does, after joining)."""
  global _ACTIVE
  _ACTIVE = PeerWatch(client, index, count, timeout_s=timeout_s).start()
  return _ACTIVE


def await_lost_process() -> None:
  """After an unexpected error: if a peer was lost (the usual cause of a failed collective),
  the watch ends this process with one line naming it; otherwise this returns once the watch
  has had time to judge (at once without a watch)."""
  if _ACTIVE is not None:
    _ACTIVE.await_verdict()


def end(*, failed: bool) -> bool:
  """Tells the other processes how this one ends (`failed`: with an error, which stops them
  too) and stops the watch. Returns whether a watch ran: several processes, whose collectives
  cannot finish without this one."""
  global _ACTIVE
  watch, _ACTIVE = _ACTIVE, None
  if watch is None:
    return False
  watch.stop(failed=failed)
  return True
