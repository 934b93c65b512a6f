"""A workdir's stored config and the changes a rerun may make to it.

`check_change(stored, requested, accept=...)` compares the config a workdir was
trained with (WORKDIR/config.json) with the one a rerun asks for. Each field is
in one of three classes:
  * free: how the run is observed or executed, not what it computes (log, eval
    and checkpoint cadence, the FFN implementation and kernels, remat, the scan
    unrolled, where the data lives): applied and logged;
  * accepted on request: the optimisation of the remaining steps (schedule,
    optimizer, L1, number of steps, compute dtype): the checkpoints still fit,
    but the run is no longer the one that was started, so the rerun needs
    `--accept_config_change`;
  * everything else (model shapes and parameter layout, the seed, the data
    stream: dataset, tokenizer, sequence length, batch size) would not fit the
    checkpoints or would silently change the data: refused, with the fields
    listed, before any checkpoint is touched.
Fields missing from one side (added or removed by a newer version of the code)
are not compared.
"""

import json
import os
from typing import Any

from train.errors import ConfigError

CONFIG_FILE = "config.json"

# Changes applied without asking (observation and execution, not the computation).
_FREE = ("log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
         "data.data_dir", "data.use_tfds", "data.prefetch", "data.workers", "data.eval_split",
         "data.index_cache_dir",
         "model.ffn_implementation", "model.attention", "model.remat", "model.scan_unroll",
         "model.interpret", "layer_choice.", "mesh.", "init_from_hf.", "compilation_cache_dir",
         "profile.")
# Changes that fit the checkpoints but change the rest of the run: need the flag.
_ACCEPTABLE = ("num_train_steps", "learning_rate", "warmup_steps", "min_lr_ratio",
               "adam_b1", "adam_b2", "adam_eps", "weight_decay", "grad_clip",
               "grad_accum_steps", "l1_coeff", "l1_warmup_steps", "l1_normalization",
               "l1_layer_scales",
               "dead_window_tokens", "dead_reinit", "dead_reinit_every", "model.dtype",
               # Where the files are: the same files elsewhere continue the same stream.
               "data.files", "data.eval_files", "data.tokenizer_file")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _in(path: str, fields: tuple) -> bool:
  return any(path == f or (f.endswith(".") and path.startswith(f)) for f in fields)


def changes(stored: dict, requested: dict) -> dict[str, list[tuple[str, Any, Any]]]:
  """{"free" | "acceptable" | "refused": [(field, stored, requested)]} of the fields in both."""
  a, b = _flatten(stored), _flatten(requested)
  out = {"free": [], "acceptable": [], "refused": []}
  for path in sorted(a.keys() & b.keys()):
    if a[path] == b[path]:
      continue
    kind = "free" if _in(path, _FREE) else "acceptable" if _in(path, _ACCEPTABLE) else "refused"
    out[kind].append((path, a[path], b[path]))
  return out


def _lines(items) -> str:
  return "; ".join(f"{path}: {old!r} -> {new!r}" for path, old, new in items)


def check_change(stored: dict | None, requested: dict, *, accept: bool, where: str):
  """Raises ConfigError unless `requested` may continue a run trained with `stored`.

  Returns the changes that apply (see `changes`) for the log. `where` names the
  stored config in messages.
  """
  if stored is None:
    return {"free": [], "acceptable": [], "refused": []}
  diff = changes(stored, requested)
  if diff["refused"]:
    msg = (f"this config does not fit the run in {where}: {_lines(diff['refused'])} "
           "(model shapes, parameter layout, seed or data stream). Nothing was changed. "
           "Rerun with the stored values, or start the new config in a new --workdir")
    if diff["acceptable"]:
      msg += (f". Also changed, acceptable with --accept_config_change: "
              f"{_lines(diff['acceptable'])}")
    raise ConfigError(msg)
  if diff["acceptable"] and not accept:
    raise ConfigError(
        f"this config changes the run in {where}: {_lines(diff['acceptable'])}. The "
        "checkpoints fit, but the remaining steps would differ from the run that was "
        "started. Nothing was changed. Rerun with --accept_config_change to continue with "
        "the new values, or with the stored ones")
  return diff


def read_workdir_config(workdir: str) -> dict | None:
  """The config stored in WORKDIR/config.json, or None if there is none."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path} is unreadable ({e}); it records the config this workdir "
                      "was trained with: restore it, or move it aside to resume with the "
                      "config saved in the latest checkpoint") from e


def write_workdir_config(workdir: str, config: dict):
  """Writes WORKDIR/config.json atomically (a complete old or new file after any crash)."""
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(config, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
