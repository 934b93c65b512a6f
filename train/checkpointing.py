"""Orbax checkpoints: periodic async saves, retention, crash-safe resume.

Layout: DIR/checkpoints/<step>/{state,data,meta}, one orbax CheckpointManager.
  state: StandardSave of the train state pytree {params, opt_state, step, rng,
         since} (arrays);
  data:  JsonSave of the input pipeline positions, {"processes": [one
         `PackedBatches.get_state()` per process]};
  meta:  JsonSave of {"step", "config", "twell_jax_version"}.
Saves are asynchronous (orbax copies the arrays to host before `save`
returns, then writes in a background thread) and atomic: a step directory
only counts once orbax has committed it, so a run killed mid-write leaves no
half checkpoint that looks complete.

Resume tries the newest step first. A step whose files are unreadable
(truncated, deleted, garbled) is moved aside to DIR/corrupt_checkpoints/ with
a warning and the next older one is tried; if none is usable a
`CheckpointError` with a plain message is raised (train.main prints it
without a traceback).
"""

import logging as logging_std
import os
import shutil
import time
from typing import Any

from absl import logging
import jax
import orbax.checkpoint as ocp

ITEMS = ("state", "data", "meta")


class CheckpointError(Exception):
  """A checkpoint problem the user must resolve; printed without traceback."""


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def make_manager(workdir: str, *, every_steps: int = 1, keep: int = 3,
                 read_only: bool = False) -> ocp.CheckpointManager:
  path = checkpoint_dir(workdir)
  if read_only and not os.path.isdir(path):
    raise CheckpointError(f"no checkpoints directory at {path}")
  options = ocp.CheckpointManagerOptions(
      save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
          max(1, every_steps)),
      preservation_policy=ocp.checkpoint_managers.LatestN(max(1, keep)),
      enable_async_checkpointing=not read_only,
      read_only=read_only,
      create=not read_only,
  )
  return ocp.CheckpointManager(path, options=options, item_names=ITEMS)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_state: dict,
         meta: dict, *, force: bool = False) -> bool:
  """Saves if the interval policy (or force) says so; returns whether it did."""
  return mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(data_state),
      meta=ocp.args.JsonSave(meta)), force=force)


def abstract_of(tree: Any, sharding=None) -> Any:
  """ShapeDtypeStructs (with `sharding` if given) for a pytree of arrays."""
  def one(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=sharding or getattr(x, "sharding",
                                                             None))
  return jax.tree.map(one, tree)


def _quarantine(workdir: str, step: int) -> str:
  src = os.path.join(checkpoint_dir(workdir), str(step))
  dst_root = os.path.join(os.path.abspath(workdir), "corrupt_checkpoints")
  os.makedirs(dst_root, exist_ok=True)
  dst = os.path.join(dst_root, f"{step}-{int(time.time())}")
  shutil.move(src, dst)
  return dst


# Directories of steps this process found unreadable (see _mark_damaged).
_DAMAGED_STEP_DIRS: set[str] = set()


def _mark_damaged(workdir: str, step: int) -> None:
  """Remembers a damaged step so the read noise it leaves behind is dropped."""
  path = os.path.join(checkpoint_dir(workdir), str(step)) + os.sep
  _DAMAGED_STEP_DIRS.update({path, os.path.realpath(path) + os.sep})


class _DamagedStepNoise(logging_std.Filter):
  """Drops asyncio's reports about reads of a step already reported damaged.

  When one array of a damaged step fails, orbax abandons the restore while
  tensorstore is still finishing the reads of its sibling arrays. Those fail
  too, and when the abandoned futures are garbage-collected asyncio logs
  "Future/Task exception was never retrieved" with a full traceback, once
  per array, at a moment that depends on thread timing (so a run may or may
  not print them). The user already has one clear warning per damaged step;
  only records that name a damaged step's directory are dropped.
  """

  def filter(self, record):
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
      text += str(record.exc_info[1])
    return not any(path in text for path in _DAMAGED_STEP_DIRS)


def _silence_damaged_read_noise():
  """Installs (once) the filters for the noise a failed restore leaves.

  * asyncio's "exception was never retrieved" records about damaged steps
    (`_DamagedStepNoise`);
  * "Event loop is closed": tensorstore keeps completing reads and calls
    back into orbax's already closed asyncio loop; Python reports each as an
    unraisable RuntimeError with a traceback. Only these are filtered; every
    other unraisable exception still reaches the old hook.
  """
  import sys  # pylint: disable=g-import-not-at-top
  asyncio_logger = logging_std.getLogger("asyncio")
  if not any(isinstance(f, _DamagedStepNoise) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_DamagedStepNoise())
  previous = sys.unraisablehook
  if getattr(previous, "_twell_filter", False):
    return

  def hook(unraisable):
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
      return
    previous(unraisable)

  hook._twell_filter = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


def _short(e: Exception) -> str:
  first = str(e).splitlines()[0] if str(e) else ""
  return f"{type(e).__name__}: {first[:200]}"


def restore_latest(workdir: str, abstract_state: Any, **manager_kwargs):
  """Restores the newest usable checkpoint.

  Returns (manager, restored) where restored is None for a fresh run, else a
  dict with keys step, state, data, meta. Unreadable steps are quarantined
  (see module docstring) and the manager is re-opened without them.
  """
  _silence_damaged_read_noise()
  mngr = make_manager(workdir, **manager_kwargs)
  steps = sorted(mngr.all_steps(), reverse=True)
  errors = []
  for step in steps:
    try:
      out = mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state),
          data=ocp.args.JsonRestore(),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      # Orbax raises many types (ValueError, FileNotFoundError, tensorstore
      # errors...) for a damaged step; all mean "not usable".
      msg = _short(e)
      _mark_damaged(workdir, step)
      errors.append(f"step {step}: {msg}")
      mngr.close()
      moved = _quarantine(workdir, step)
      logging.warning("Checkpoint step %d is unreadable (%s); moved it to %s "
                      "and trying an older one.", step, msg, moved)
      mngr = make_manager(workdir, **manager_kwargs)
      continue
    return mngr, {"step": step, "state": out.state, "data": out.data,
                  "meta": out.meta}
  if errors:
    mngr.close()
    raise CheckpointError(
        "no usable checkpoint in " + checkpoint_dir(workdir) + " (damaged "
        "ones were moved to corrupt_checkpoints/): " + "; ".join(errors) +
        ". Use a new --workdir to start from scratch.")
  return mngr, None


def _pick_step(mngr, workdir: str, step: int | None) -> int:
  steps = mngr.all_steps()
  if not steps:
    raise CheckpointError(f"no checkpoints in {checkpoint_dir(workdir)}")
  if step is None:
    return max(steps)
  if step not in steps:
    raise CheckpointError(f"no checkpoint for step {step} in "
                          f"{checkpoint_dir(workdir)}; have {sorted(steps)}")
  return step


def _unreadable(workdir, step, e) -> CheckpointError:
  _mark_damaged(workdir, step)
  return CheckpointError(f"checkpoint step {step} in {checkpoint_dir(workdir)}"
                         f" is unreadable ({_short(e)})")


def read_meta(workdir: str, step: int | None = None) -> tuple[int, dict]:
  """(step, meta) of `step` (default: the latest), read-only."""
  mngr = make_manager(workdir, read_only=True)
  try:
    step = _pick_step(mngr, workdir, step)
    try:
      out = mngr.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise _unreadable(workdir, step, e) from None
    return step, out.meta
  finally:
    mngr.close()


def restore_params(workdir: str, abstract_params: Any, step: int):
  """Read-only restore of only the params of `step` (for evaluation).

  Raises CheckpointError with a plain message if it cannot be read.
  """
  _silence_damaged_read_noise()
  mngr = make_manager(workdir, read_only=True)
  try:
    step = _pick_step(mngr, workdir, step)
    item = {"params": abstract_params}
    try:
      out = mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
              item=item,
              restore_args=ocp.checkpoint_utils.construct_restore_args(item),
              partial_restore=True)))
    except Exception as e:  # pylint: disable=broad-except
      raise _unreadable(workdir, step, e) from None
    return out.state["params"]
  finally:
    mngr.close()
