"""A run longer than one command's time limit: stopped with a checkpoint, continued by the same
command, its wall-clock the sum of its calls.

`python -m train.launch --stop_after_s=T` sends SIGTERM after T seconds: every process finishes
its step, writes that step's checkpoint and exits 143 (`train.training.preemption`). The
benchmark records that call in WORKDIR.calls.json ([{"start": time.time() at its start,
"wall_s"}]); the same command later finds the record, keeps the workdir and continues the run
from its checkpoint. Once the run ends, its wall-clock is the sum of its calls' (`total`), and a
moment of any call maps onto the run's own clock by `clock` (the calls laid end to end, the
time between them left out).
"""

from __future__ import annotations

import json
import os
from typing import Callable



def _path(workdir: str) -> str:
  return workdir.rstrip("/") + ".calls.json"


def earlier(workdir: str) -> list[dict]:
  """The recorded calls of a stopped run in `workdir` (none if it holds no checkpoint)."""
  from train.state import checkpointing  # pylint: disable=import-outside-toplevel
  if not os.path.exists(_path(workdir)) or not checkpointing.steps_on_disk(workdir):
    return []
  with open(_path(workdir)) as f:
    return json.load(f)


def continues(workdir: str) -> bool:
  """Whether the run in `workdir` was stopped and can continue (a record and a checkpoint);
  if not, any record left is dropped: the run starts over."""
  if earlier(workdir):
    return True
  if os.path.exists(_path(workdir)):
    os.remove(_path(workdir))
  return False


def record(workdir: str, start: float, wall_s: float) -> list[dict]:
  """Adds a call that stopped the run; returns every call so far."""
  calls = earlier(workdir) + [{"start": start, "wall_s": wall_s}]
  with open(_path(workdir), "w") as f:
    json.dump(calls, f)
  return calls


def finish(workdir: str) -> list[dict]:
  """The earlier calls of a run that has now ended; the record is removed (the same command
  then starts a new run)."""
  calls = earlier(workdir)
  if os.path.exists(_path(workdir)):
    os.remove(_path(workdir))
  return calls


def total(calls: list[dict], wall_s: float) -> float:
  """The run's wall-clock: its earlier calls' and the last one's `wall_s`."""
  return sum(c["wall_s"] for c in calls) + wall_s


def clock(calls: list[dict], start: float) -> Callable[[float], float]:
  """A function from a moment (time.time()) of one of the calls (`calls`, then the last one,
  begun at `start`) to the seconds of the run's clock."""
  spans, offset = [], 0.0
  for c in calls:
    spans.append((c["start"], offset))
    offset += c["wall_s"]
  spans.append((start, offset))

  def seconds(moment: float) -> float:
    begun, before = max((s for s in spans if s[0] <= moment), default=spans[0])
    return before + moment - begun

  return seconds
