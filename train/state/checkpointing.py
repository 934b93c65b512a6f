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

Resume tries the newest step first, in two checks:
  1. fit: the step's stored array names, shapes and dtypes (its metadata) must
     be those of the state this config builds. A step that does not fit was
     written for another model; nothing is moved and a `CheckpointError` lists
     the differences (train.main prints it without a traceback).
  2. integrity: the step must restore completely. A step whose files are
     unreadable (truncated, deleted, garbled: metadata or arrays) is moved
     aside to DIR/corrupt_checkpoints/ with a warning and the next older one
     is tried; if none is usable a `CheckpointError` says so.
A workdir whose checkpoints were all moved aside is not silently restarted
from step 0: `restore_latest` refuses unless `allow_fresh_start=True`.
"""

import logging as logging_std
import os
import shutil
import time
from typing import Any

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp

from train import errors

ITEMS = ("state", "data", "meta")


CheckpointError = errors.CheckpointError


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


def steps_on_disk(workdir: str) -> list[int]:
  """Committed steps in DIR/checkpoints (names only; nothing is read or opened)."""
  path = checkpoint_dir(workdir)
  return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def _write_failed(mngr: ocp.CheckpointManager, e: Exception) -> "CheckpointError":
  _silence_damaged_read_noise()
  _mark_failed(str(mngr.directory))
  complete = steps_on_disk(os.path.dirname(str(mngr.directory)))
  then = (f"the complete checkpoints are steps {complete}; rerun the same command to resume "
          f"from step {complete[-1]} once the cause (disk space, permissions) is fixed."
          if complete else "no checkpoint is complete yet; fix the cause (disk space, "
          "permissions) and rerun.")
  return CheckpointError(f"writing a checkpoint to {mngr.directory} failed ({_short(e)}); "
                         + then)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_state: dict,
         meta: dict, *, force: bool = False) -> bool:
  """Saves if the interval policy (or force) says so; returns whether it did.

  A failed write (of this step, or of an earlier one still finishing in the
  background) raises CheckpointError naming the complete checkpoints left.
  """
  try:
    return mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)), force=force)
  except Exception as e:  # pylint: disable=broad-except
    raise _write_failed(mngr, e) from e


def finish(mngr: ocp.CheckpointManager):
  """Waits for the writes in flight to commit and closes `mngr` (CheckpointError if one
  failed)."""
  error = None
  try:
    mngr.wait_until_finished()
    mngr.check_for_errors()
  except Exception as e:  # pylint: disable=broad-except
    error = e
  try:
    mngr.close()
  except Exception as e:  # pylint: disable=broad-except
    error = error or e
  if error is not None:
    raise _write_failed(mngr, error) from error


def abstract_of(tree: Any, sharding=None) -> Any:
  """ShapeDtypeStructs (with `sharding` if given) for a pytree of arrays."""
  def one(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=sharding or getattr(x, "sharding",
                                                             None))
  return jax.tree.map(one, tree)


def quarantine_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "corrupt_checkpoints")


def _quarantine(workdir: str, step: int) -> str:
  src = os.path.join(checkpoint_dir(workdir), str(step))
  dst_root = quarantine_dir(workdir)
  os.makedirs(dst_root, exist_ok=True)
  dst = os.path.join(dst_root, f"{step}-{int(time.time())}")
  shutil.move(src, dst)
  return dst


# Directories whose checkpoint reads or writes failed and were reported (see _mark_failed).
_FAILED_DIRS: set[str] = set()


def _mark_failed(path: str) -> None:
  """Remembers a directory already reported so the noise its failure leaves is dropped."""
  _FAILED_DIRS.update({path.rstrip(os.sep) + os.sep, os.path.realpath(path) + os.sep})


def _mark_damaged(workdir: str, step: int, damaged: bool = True) -> None:
  """Marks (or, `damaged` false, unmarks) a step's directory as failed (`_mark_failed`)."""
  path = os.path.join(checkpoint_dir(workdir), str(step))
  if damaged:
    _mark_failed(path)
  else:
    _FAILED_DIRS.difference_update({path.rstrip(os.sep) + os.sep,
                                    os.path.realpath(path) + os.sep})


class _DamagedStepNoise(logging_std.Filter):
  """Drops asyncio's reports about checkpoint reads and writes already reported failed.

  When one array of a damaged step fails, orbax abandons the restore while
  tensorstore is still finishing the reads of its sibling arrays; when one
  write fails (a full disk), the sibling writes fail too. Those failures
  surface when the abandoned futures are garbage-collected: asyncio logs
  "Future/Task exception was never retrieved" with a full traceback, once
  per array, at a moment that depends on thread timing (so a run may or may
  not print them, possibly after the error that ends it). The user already
  has one clear message per failure; only records that name a failed
  directory are dropped.
  """

  def filter(self, record):
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
      text += str(record.exc_info[1])
    return not any(path in text for path in _FAILED_DIRS)


def _silence_damaged_read_noise():
  """Installs (once) the filters for the noise a failed restore or write leaves.

  * asyncio's "exception was never retrieved" records about failed
    directories (`_DamagedStepNoise`);
  * "Event loop is closed": tensorstore keeps completing reads and calls
    back into orbax's already closed asyncio loop; Python reports each as an
    unraisable RuntimeError with a traceback. Only these are filtered; every
    other unraisable exception still reaches the old hook.
  * "coroutine 'async_serialize_from_host.<locals>.write_fragment' was never
    awaited": the sibling array writes a failed write abandons, reported (a
    RuntimeWarning) when they are collected, possibly at interpreter exit,
    after the error that ended the run.
  """
  import sys  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.filterwarnings("ignore", category=RuntimeWarning,
                          message=r"coroutine 'async_serialize\S*' was never awaited")
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


def _misfit(mngr: ocp.CheckpointManager, step: int, abstract_state: Any) -> str | None:
  """How `step`'s stored arrays differ from `abstract_state` (None: they fit).

  Reads only the step's metadata; raises whatever orbax raises when that is unreadable.
  """
  state_dir = os.path.join(str(mngr.directory), str(step), "state")
  metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(state_dir))
  stored = {leaf.name: (tuple(leaf.shape), str(leaf.dtype)) for leaf in jax.tree.leaves(metadata)}
  wanted = {".".join(ocp.tree.str_keypath(path)): (tuple(a.shape), str(a.dtype))
            for path, a in jax.tree_util.tree_leaves_with_path(abstract_state)}
  if not stored:
    raise ValueError("no array metadata")
  # Parameters first: the optimizer state mirrors them.
  order = lambda names: sorted(names, key=lambda n: (not n.startswith("params."), n))
  problems = [f"{name}: stored {stored[name][1]}{list(stored[name][0])}, this config "
              f"{wanted[name][1]}{list(wanted[name][0])}"
              for name in order(stored.keys() & wanted.keys()) if stored[name] != wanted[name]]
  problems += [f"{name}: only in the checkpoint" for name in order(stored.keys() - wanted)]
  problems += [f"{name}: not in the checkpoint" for name in order(wanted.keys() - stored)]
  if not problems:
    return None
  more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
  return "; ".join(problems[:6]) + more


def restore_latest(workdir: str, abstract_state: Any, *, allow_fresh_start: bool = False,
                   **manager_kwargs):
  """Restores the newest usable checkpoint.

  Returns (manager, restored) where restored is None for a fresh run, else a
  dict with keys step, state, data, meta. Unreadable steps are quarantined
  (see module docstring) and the manager is re-opened without them; a step
  that does not fit `abstract_state` stops the restore with a CheckpointError
  and is left in place. With no checkpoint left but quarantined ones in
  DIR/corrupt_checkpoints/, CheckpointError unless `allow_fresh_start`.
  """
  _silence_damaged_read_noise()
  mngr = make_manager(workdir, **manager_kwargs)
  steps = sorted(mngr.all_steps(), reverse=True)
  errors = []
  for step in steps:
    misfit = None
    # Marked before the read: asyncio may report a sibling read's failure before the restore
    # raises its own (`_DamagedStepNoise`).
    _mark_damaged(workdir, step)
    try:
      misfit = _misfit(mngr, step, abstract_state)
      if misfit is None:
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
    _mark_damaged(workdir, step, damaged=False)
    if misfit is not None:
      mngr.close()
      raise CheckpointError(
          f"checkpoint step {step} in {checkpoint_dir(workdir)} does not fit the model of "
          f"this config: {misfit}. Nothing was moved. Resume with the config that wrote "
          "it (WORKDIR/config.json), or start this config in a new --workdir.")
    return mngr, {"step": step, "state": out.state, "data": out.data,
                  "meta": out.meta}
  if errors:
    mngr.close()
    raise CheckpointError(
        "no usable checkpoint in " + checkpoint_dir(workdir) + " (damaged "
        "ones were moved to corrupt_checkpoints/): " + "; ".join(errors) +
        ". Use a new --workdir to start from scratch.")
  quarantined = (sorted(os.listdir(quarantine_dir(workdir)))
                 if os.path.isdir(quarantine_dir(workdir)) else [])
  if quarantined and not allow_fresh_start:
    mngr.close()
    raise CheckpointError(
        f"{checkpoint_dir(workdir)} holds no checkpoint, and earlier ones of this workdir "
        f"were moved to {quarantine_dir(workdir)} as damaged ({', '.join(quarantined)}); "
        "not starting over from step 0 on its own. Repair or restore them, use a new "
        "--workdir, or pass --allow_fresh_start to train this workdir from scratch.")
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


def check_workdir(workdir: str, requested: dict, *, accept: bool) -> dict:
  """`train.config.workdir.check_change` of `requested` against the run in `workdir`, if it
  has checkpoints. The stored config is WORKDIR/config.json, else the one in the latest
  checkpoint's metadata. A workdir without checkpoints has nothing to protect: no comparison.
  """
  from train.config import workdir as workdir_config  # pylint: disable=g-import-not-at-top
  if not steps_on_disk(workdir):
    return workdir_config.check_change(None, requested, accept=accept, where=workdir)
  stored = workdir_config.read_workdir_config(workdir)
  where = os.path.join(workdir, workdir_config.CONFIG_FILE)
  if stored is None:
    try:
      step, meta = read_meta(workdir)
    except CheckpointError:
      stored = None   # the restore reports the damage
    else:
      stored, where = meta.get("config"), f"checkpoint step {step} of {workdir}"
  return workdir_config.check_change(stored, requested, accept=accept, where=where)


def meta(cfg, step: int, choice_meta: dict | None = None) -> dict:
  """A checkpoint's metadata: the step, the config, the version and the per-layer choice
  (`ChoiceSteps.meta`: a resumed run continues with it, the same numerics on the same steps)."""
  import twell_jax  # pylint: disable=g-import-not-at-top
  return {"step": int(step), "config": cfg.to_dict(),
          "twell_jax_version": getattr(twell_jax, "__version__", "?"), **(choice_meta or {})}
