r"""Training throughput per mesh: the sparse and the dense model on 1 device and on many.

    python -m benchmarks.scaling --out=scaling.json                 # 1, 2, 4, ... all GPUs
    python -m benchmarks.scaling --meshes=1x1,2x1,1x2 --layers=4    # explicit meshes
    python -m benchmarks.scaling --options=trainer,zero1,gspmd_reduction+priority  # compared
    python -m benchmarks.scaling --scan_layers=false                # one block per layer
    python -m benchmarks.scaling --remat --grad_accum=4             # the trainer's accumulation
    python -m benchmarks.scaling --shape=tiny --weights=init --meshes=1x1 --iters=2   # CPU

Each mesh DATAxFSDP runs the trainer's own step (`train.trainer_lib.Trainer`: the FFN and the
loss per device under shard_map, parameters split over fsdp) with `--batch_per_device`
sequences of the shape's context per device, for two models at the paper's shape with
`--layers` layers (as `benchmarks.e2e`):

  * sparse: ReLU + L1 as the trainer runs it: the per-layer choice (`train.models.layer_choice`)
    decides each layer's FFN and hot features from one step's feature counts and the
    features are sorted by popularity, as `train.main` does on its first step; on weights
    trained to the paper-like activity (`benchmarks.common.trained`, cached; `--weights=init`:
    random);
  * dense: the same weights with a SiLU FFN on the dense implementation.

A mesh of several devices is compiled with each of `--options`: "trainer" (the trainer's
own config and XLA's defaults), XLA option sets to compare (`OPTION_SETS`) and trainer
config changes (`CONFIG_SETS`: "gspmd_reduction", the gradients reduced by XLA inside the
backward; "zero1", the optimizer's moments split over the devices), several joined by "+".
`--one_device_on` times the 1-device mesh on each listed device. With `--frozen_weights`
(the default) the steps run at learning rate 0: the same computation, but the weights stay
those the run starts from, so every measurement (synchronized, back-to-back, each mesh) sees
the same activity; training one batch over and over would drift it, and the sparse kernels'
cost with it.
Per mesh, model and option set: tokens/s of back-to-back steps, as the trainer runs them
(it reads the device only every `log_every` steps), per device, and the scaling efficiency
against the 1-device mesh (tokens/s over devices x the 1-device tokens/s); the same of
synchronized steps (`synced_*`: each step waited for, so each pays its launch); the compiled
step's collectives by kind, every one that moves something other
than a weight (`benchmarks.common.hlo.non_weight_collectives`; expected: none), how many of the
asynchronous ones overlap compute and how many bytes they move
(`benchmarks.common.hlo.collective_overlap`), XLA's peak memory estimate and each device's measured
peak.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import time

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks.common import timing
from benchmarks.common import trained


def _define_flags():
  flags.DEFINE_list("meshes", None, "DATAxFSDP meshes (default: data parallel over 1, 2, "
                    "4, ... devices and over all N: `default_meshes`)")
  flags.DEFINE_enum("shape", "paper", ["paper", "tiny"], "paper: D=2048, H=5632; tiny: CPU")
  flags.DEFINE_integer("layers", 4, "layers of the paper shape")
  flags.DEFINE_integer("batch_per_device", 8, "sequences per device and micro-batch")
  flags.DEFINE_integer("grad_accum", 1, "micro-batches per step (the paper configs: 8), their "
                       "gradients summed on each device and reduced once per step")
  flags.DEFINE_integer("iters", 10, "timed steps per measurement")
  flags.DEFINE_enum("weights", "trained", ["trained", "init"], "paper-like trained or random")
  flags.DEFINE_integer("train_steps", 1500, "training steps of the trained weights (cached)")
  flags.DEFINE_string("cache_dir", trained.DEFAULT_CACHE, "where trained weights are kept")
  flags.DEFINE_string("sparse", "mosaic_gpu", "the sparse model's FFN implementation")
  flags.DEFINE_list("models", ["sparse", "dense"], "sparse, dense")
  flags.DEFINE_bool("remat", False, "rematerialize each block")
  flags.DEFINE_bool("scan_unroll", False, "with --scan_layers: the scan fully unrolled")
  flags.DEFINE_bool("frozen_weights", True, "time the steps at learning rate 0 (unchanged "
                    "weights: the same activity in every measurement)")
  flags.DEFINE_bool("scan_layers", True, "the layers as a lax.scan over stacked weights (the "
                    "paper configs' layout), else one unrolled block per layer")
  flags.DEFINE_list("options", ["trainer", "gspmd_reduction"],
                    "XLA option sets for meshes of several devices: " + ", ".join(OPTION_SETS))
  flags.DEFINE_string("dump_hlo", None, "write each compiled step's HLO text to this folder")
  flags.DEFINE_string("profile_dir", None, "trace 3 steps of each run into this folder "
                      "(jax.profiler, with a Perfetto trace; summarized into the run's "
                      "\"profile\": benchmarks.common.timing.trace_breakdown)")
  flags.DEFINE_list("one_device_on", ["0"], "device indices the 1x1 mesh runs on, one after "
                    "the other (efficiency is against the first; each one's own is recorded)")
  flags.DEFINE_string("choose_mesh", "1x1", "DATAxFSDP mesh whose first step makes the sparse "
                      "model's per-layer choice (a model too large for one device: a mesh "
                      "that holds it)")
  flags.DEFINE_list("merge", [], "instead of running: results JSONs of this machine (each model "
                    "at its own setting) merged into one with the sparse/dense ratios per "
                    "depth and mesh (`merge_results`)")
  flags.DEFINE_string("out", None, "write the results as JSON here")


# XLA option sets the train step on several devices is compiled with ("trainer": none, the
# trainer's own; XLA's latency-hiding scheduler is on by default).
OPTION_SETS = {
    "trainer": {},
    "no_lhs": {"xla_gpu_enable_latency_hiding_scheduler": False},
    "combine_256m": {"xla_gpu_all_reduce_combine_threshold_bytes": 256 << 20},
    "combine_8m": {"xla_gpu_all_reduce_combine_threshold_bytes": 8 << 20},
    "priority": {"xla_gpu_enable_highest_priority_async_stream": True},
    "overlap2": {"xla_gpu_experimental_parallel_collective_overlap_limit": 2},
    "double_buffer": {"xla_gpu_enable_while_loop_double_buffering": True},
    "overlap2_db": {"xla_gpu_experimental_parallel_collective_overlap_limit": 2,
                    "xla_gpu_enable_while_loop_double_buffering": True},
    "sol": {"xla_gpu_enable_analytical_sol_latency_estimator": True},
    "user_buffers": {"xla_gpu_enable_nccl_user_buffers": True},
    "symmetric": {"xla_gpu_experimental_enable_nccl_symmetric_buffers": True},
    # Not XLA options: the trainer's config changed (`CONFIG_SETS`).
    "zero1": {},
    "gspmd_reduction": {},
}
# Option sets that change the trainer's config instead: {set: {mesh config field: value}}.
CONFIG_SETS = {"zero1": {"shard_optimizer": True},
               "gspmd_reduction": {"gradient_reduction": "gspmd"}}


def compiler_options(options: str) -> dict:
  """The XLA options of `options`: one set's name or several joined by "+"."""
  return {k: v for name in options.split("+") for k, v in OPTION_SETS[name].items()}


def config_options(options: str) -> dict:
  return {k: v for name in options.split("+") for k, v in CONFIG_SETS.get(name, {}).items()}


def _config(fl, model: str, data: int, fsdp: int, options: str = "trainer"):
  base = "tiny" if fl.shape == "tiny" else "paper_0p5b"
  cfg = trained.config_for(base, batch=fl.batch_per_device * data * fsdp * fl.grad_accum)
  cfg.grad_accum_steps = fl.grad_accum
  if fl.shape != "tiny":
    cfg.model.n_layers = fl.layers
  cfg.model.remat = fl.remat
  cfg.model.scan_layers = fl.scan_layers
  cfg.model.scan_unroll = fl.scan_unroll
  if fl.frozen_weights:
    cfg.learning_rate = 0.0
  cfg.mesh.update(data=data, fsdp=fsdp, **config_options(options))
  if model == "sparse":
    # The per-layer choice picks each layer's FFN (ffn_implementation None), as in training.
    cfg.model.update(ffn_implementation=None, ffn_activation="relu")
    cfg.layer_choice.update(enabled=True, sparse=fl.sparse)
    cfg.l1_coeff = trained.PAPER_L1
  else:
    cfg.model.update(ffn_implementation="dense", ffn_activation="silu")
    cfg.layer_choice.enabled = False
    cfg.l1_coeff = 0.0
  return cfg


def _params(fl):
  """Trained parameters with the benchmark's layer count, or None for a random init."""
  if fl.weights == "init":
    return None
  base = "tiny" if fl.shape == "tiny" else "paper_0p5b"
  _, params = trained.trained_params(base, "paper", steps=fl.train_steps, extreme_steps=0,
                                     cache_dir=fl.cache_dir)
  if fl.shape != "tiny":
    params = trained.repeat_layers(params, fl.layers)
  if not fl.scan_layers:
    params = loop_layout(params)
  # On the host: each mesh's state is a fresh copy, which its step donates (an array already
  # on the mesh's device would be placed as is, and deleted by the first step).
  return jax.device_get(params)


def loop_layout(params):
  """Parameters of the scan layout (every block leaf stacked over [L]) in the loop layout:
  params["blocks"] = {layer: that layer's block}."""
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  n = jax.tree.leaves(params["blocks"])[0].shape[0]
  return {**params, "blocks": dict(enumerate(model_lib.unstacked_blocks(params["blocks"], n)))}


def _state(tr, params):
  state = tr.new_state(jax.random.key(0))
  if params is None:
    return state
  params = jax.device_put(params, tr.state_sharding["params"])
  opt_state = jax.jit(tr.tx.init, out_shardings=tr.state_sharding["opt_state"])(params)
  return {**state, "params": params, "opt_state": opt_state}


def default_meshes(n: int) -> list[str]:
  """Data parallel over 1, 2, 4, ... devices up to all `n` of the machine ("1x1", "2x1", ...):
  the scaling curve of a node in one call."""
  sizes = [1 << i for i in range(n.bit_length()) if 1 << i < n] + [n]
  return [f"{k}x1" for k in sizes]


def parse_mesh(text: str) -> tuple[int, int]:
  """(data, fsdp) of a "DATAxFSDP" flag value; app.UsageError naming the value otherwise."""
  parts = text.split("x")
  if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise app.UsageError(f"mesh {text!r}: expected DATAxFSDP, e.g. 1x4 (fsdp over 4 devices)")
  return int(parts[0]), int(parts[1])


def _choose(fl, params):
  """The sparse model's per-layer choice on the `--choose_mesh` mesh, as the trainer's first
  step makes it: (`LayerChoice.key`, the popularity order [L, H] that sorts the features, the
  description and the predicted per-layer ratios). None where the config makes no choice."""
  from train.runtime import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from train.models import implementations  # pylint: disable=import-outside-toplevel
  from train.state import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  data, fsdp = parse_mesh(fl.choose_mesh)
  cfg = _config(fl, "sparse", data, fsdp)
  tr = trainer_lib.Trainer(cfg, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:data * fsdp]))
  choice = implementations.layer_choice(cfg, tr.model_cfg, tr.mesh.size)
  if choice is None:
    return None
  state = _state(tr, params)
  batch = _batch(tr, cfg)
  _, m = tr.jit_train_step(choice.key)(state, batch)
  tokens = cfg.batch_size * cfg.data.seq_len
  _, order = choice.update_from_counts(jax.device_get(m["feature_counts"]), tokens)
  return {"key": choice.key, "order": order,
          "describe": choice.describe(), "predicted": [float(r) for r in choice.predicted]}


def _batch(tr, cfg):
  from train.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
  packer = data_lib.PackedBatches(
      data_lib.make_source(cfg.data, cfg.data.train_split), tr.tokenizer,
      seq_len=cfg.data.seq_len, rows=cfg.batch_size, seed=cfg.seed + 7)
  rows = packer.next_batch().astype(np.int32)
  return tr.put_batch(rows.reshape(cfg.grad_accum_steps, -1, rows.shape[-1]),
                      tr.batch_sharding)


def run_mesh(fl, model: str, data: int, fsdp: int, params, *, choice=None,
             options: str = "trainer", first_device: int = 0) -> dict:
  """One model on one mesh with one option set (`OPTION_SETS`), on the devices from
  `first_device` on; `choice` (from `_choose`) gives the sparse model's layers and feature
  order."""
  from benchmarks.common import hlo  # pylint: disable=import-outside-toplevel
  from train.runtime import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from train.state import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  cfg = _config(fl, model, data, fsdp, options)
  n = data * fsdp
  devices = jax.devices()[first_device:first_device + n]
  tr = trainer_lib.Trainer(cfg, mesh=mesh_lib.make_mesh(cfg.mesh, devices))
  state = _state(tr, params)
  key = None
  if model == "sparse" and choice is not None:
    key = choice["key"]
    state = tr.sort_features(state, choice["order"])
  batch = _batch(tr, cfg)
  t0 = time.time()
  step = tr.jit_train_step(key).lower(state, batch).compile(
      compiler_options=compiler_options(options) or None)
  compile_s = time.time() - t0
  text = step.as_text()
  if getattr(fl, "dump_hlo", None):
    os.makedirs(fl.dump_hlo, exist_ok=True)
    with open(os.path.join(fl.dump_hlo, f"{model}_{data}x{fsdp}_{options}.hlo"), "w") as f:
      f.write(text)
  found = hlo.collectives(text)
  overlap = hlo.collective_overlap(text)
  shapes = [p.shape for p in jax.tree.leaves(state["params"])]
  synced, state, m = timing.synced_steps_ms(step, state, batch, iters=fl.iters)
  ms, state = timing.pipelined_ms(step, state, batch, iters=fl.iters, rounds=3, carry=True)
  profile = None
  if getattr(fl, "profile_dir", None):
    trace_dir = os.path.join(fl.profile_dir, f"{model}_{data}x{fsdp}_{options}")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(3):
        state, m = step(state, batch)
      jax.block_until_ready(state)
    profile = timing.trace_breakdown(trace_dir, steps=3, top=40)
  tokens = cfg.batch_size * cfg.data.seq_len
  med = statistics.median(synced)
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in tr.mesh.devices.flat]
  kinds = collections.Counter(kind for kind, _ in found)
  return {
      "model": model, "mesh": f"{data}x{fsdp}", "devices": n, "options": options,
      "device_ids": [d.id for d in devices],
      "scan_layers": fl.scan_layers, "scan_unroll": fl.scan_unroll,
      "frozen_weights": fl.frozen_weights,
      "compiler_options": compiler_options(options), "config_options": config_options(options),
      "split_moments": mesh_lib.split_count(tr.grad_sharding)[0], "tokens_per_step": tokens,
      "ffn_per_layer": None if key is None else choice["describe"],
      "ms": ms, "tokens_per_s": tokens / ms * 1e3,
      "tokens_per_s_per_device": tokens / ms * 1e3 / n,
      "synced_ms": med, "synced_tokens_per_s": tokens / med * 1e3, "compile_s": compile_s,
      "collectives": dict(kinds),
      "async_collectives": len(overlap),
      "overlapped_collectives": sum(o["between"] > 0 for o in overlap),
      "collective_bytes": sum(o["bytes"] for o in overlap),
      "overlapped_bytes": sum(o["bytes"] for o in overlap if o["between"] > 0),
      "non_weight_collectives": [list(c) for c in
                                 hlo.non_weight_collectives(found, shapes, fsdp, n)],
      "xla_peak_bytes_per_device": timing.peak_bytes(step),
      "measured_peak_bytes_per_device": peaks,
      "active_per_token": [float(a) for a in np.asarray(m["active_per_token"])],
      "loss": float(m["loss"]),
      "profile": profile,
  }


# Per run, the settings of the invocation that made it (kept when results are merged).
_SETTINGS = ("layers", "batch_per_device", "grad_accum", "remat", "weights", "train_steps")


def merge_results(results: list[dict]) -> dict:
  """Several invocations' results (each model at its own setting: remat, micro-batches) as
  one: every run with its invocation's `_SETTINGS`, and per depth and mesh the sparse model's
  tokens/s over the dense one's (`speedup`), the timed step's compiled peak memory per device
  over the dense one's (`peak_memory_ratio`, XLA's memory analysis) and the processes' largest
  measured peaks' (`process_peak_ratio`: a process that trained its weights first, as the
  sparse one does with `--weights=trained`, counts that run's peak too)."""
  runs = [{**{k: r[k] for k in _SETTINGS if k in r}, **run}
          for r in results for run in r["runs"] if "error" not in run]
  ratios = []
  for layers in sorted({run["layers"] for run in runs}):
    for mesh in sorted({run["mesh"] for run in runs}):
      pick = {run["model"]: run for run in runs
              if run["layers"] == layers and run["mesh"] == mesh}
      if {"sparse", "dense"} <= set(pick):
        sp, de = pick["sparse"], pick["dense"]
        peak = lambda run: max(p or 0 for p in run["measured_peak_bytes_per_device"])
        ratios.append({"layers": layers, "mesh": mesh,
                       "speedup": sp["tokens_per_s"] / de["tokens_per_s"],
                       "peak_memory_ratio": (sp["xla_peak_bytes_per_device"]
                                             / max(de["xla_peak_bytes_per_device"], 1)),
                       "process_peak_ratio": peak(sp) / max(peak(de), 1)})
  first = results[0]
  return {"device": first["device"], "device_count": first["device_count"],
          "jax": first["jax"], "runs": runs, "ratios": ratios,
          "failed": [run for r in results for run in r["runs"] if "error" in run]}


def _merge_files(paths, out) -> None:
  """`--merge`: the results files at `paths` merged (`merge_results`), printed, written to
  `out`."""
  loaded = []
  for path in paths:
    with open(path) as f:
      loaded.append(json.load(f))
  merged = merge_results(loaded)
  for r in merged["ratios"]:
    print(f"  {r['layers']} layers, mesh {r['mesh']}: sparse {r['speedup']:.3f}x dense, "
          f"step's peak memory {r['peak_memory_ratio']:.3f}x (process peaks "
          f"{r['process_peak_ratio']:.3f}x)", flush=True)
  if out:
    with open(out, "w") as f:
      json.dump(merged, f, indent=1)


def _add_efficiency(r: dict, one_device_runs: list[dict]) -> None:
  """A run's scaling efficiency against the model's first one-device run, and against each
  device's own one-device run (devices of one host differ by a few percent)."""
  if not one_device_runs or r["devices"] == 1:
    return
  one = one_device_runs[0]
  for key in ("", "synced_"):
    r[f"{key}scaling_efficiency"] = (r[f"{key}tokens_per_s"]
                                     / (r["devices"] * one[f"{key}tokens_per_s"]))
  r["scaling_efficiency_by_one_device"] = {
      str(x["device_ids"][0]): r["tokens_per_s"] / (r["devices"] * x["tokens_per_s"])
      for x in one_device_runs}


def _print_run(r: dict) -> None:
  """One run's line (and its trace's, if profiled)."""
  print(f"  {r['model']:<6} mesh {r['mesh']:<5} {r['options']:<16} "
        f"{r['tokens_per_s']:>12,.0f} tok/s ({r['tokens_per_s_per_device']:,.0f} per "
        f"device" + (f", efficiency {r['scaling_efficiency']:.3f}"
                     if "scaling_efficiency" in r else "")
        + f") {r['ms']:.1f} ms ({r['synced_ms']:.1f} synced"
        + (f", efficiency {r['synced_scaling_efficiency']:.3f}"
           if "synced_scaling_efficiency" in r else "")
        + f"); collectives {r['collectives']}, overlapped "
        f"{r['overlapped_collectives']}/{r['async_collectives']} "
        f"({r['overlapped_bytes'] / 2**20:.0f}/{r['collective_bytes'] / 2**20:.0f} MiB); "
        f"non-weight {len(r['non_weight_collectives'])}; XLA peak "
        f"{r['xla_peak_bytes_per_device'] / 2**30:.2f} GiB/device", flush=True)
  if r.get("profile"):
    pr = r["profile"]
    print(f"    trace per step: span {pr['span_ms']:.2f} ms, compute "
          f"{pr['compute_ms']:.2f}, idle {pr['idle_ms']:.2f}, collectives "
          f"{pr['collective_ms']:.2f} ({pr['exposed_collective_ms']:.2f} exposed)",
          flush=True)


def main(argv):
  del argv
  fl = flags.FLAGS
  if fl.merge:
    _merge_files(fl.merge, fl.out)
    return
  n = jax.device_count()
  meshes = fl.meshes or default_meshes(n)
  meshes = [parse_mesh(m) for m in meshes]
  parse_mesh(fl.choose_mesh)   # a bad one stops the run before its first mesh
  unknown = {n for o in fl.options for n in o.split("+")} - set(OPTION_SETS)
  if unknown:
    raise app.UsageError(f"--options: unknown {sorted(unknown)}; known {list(OPTION_SETS)}")
  device = jax.devices()[0].device_kind
  print(f"device: {device} x {n}", flush=True)
  params = _params(fl)
  choice = _choose(fl, params) if "sparse" in fl.models else None
  if choice is not None:
    print(f"sparse model's layers: {choice['describe']} (predicted "
          + " ".join(f"{r:.2f}" for r in choice["predicted"]) + ")", flush=True)
  results = {"device": device, "device_count": n, "jax": jax.__version__,
             "shape": fl.shape, "layers": fl.layers, "scan_layers": fl.scan_layers,
             "batch_per_device": fl.batch_per_device, "grad_accum": fl.grad_accum,
             "weights": fl.weights, "train_steps": fl.train_steps, "remat": fl.remat,
             "choose_mesh": fl.choose_mesh,
             "sparse_layers": None if choice is None else choice["describe"],
             "option_sets": {k: compiler_options(k) for k in fl.options}, "runs": []}
  for model in fl.models:
    for data, fsdp in meshes:
      runs = ([("trainer", int(i)) for i in fl.one_device_on] if data * fsdp == 1 else
              [(options, 0) for options in fl.options])
      for options, first in runs:
        try:
          r = run_mesh(fl, model, data, fsdp, params, choice=choice, options=options,
                       first_device=first)
        except Exception as e:  # pylint: disable=broad-except
          # An option set that fails (to compile, or out of memory): recorded, the rest runs.
          r = {"model": model, "mesh": f"{data}x{fsdp}", "devices": data * fsdp,
               "options": options, "error": f"{type(e).__name__}: {e}"[:500]}
          results["runs"].append(r)
          print(f"  {model:<6} mesh {r['mesh']:<5} {options:<16} failed: {r['error']}",
                flush=True)
          continue
        _add_efficiency(r, [x for x in results["runs"] if x["model"] == model
                            and x["devices"] == 1 and "error" not in x])
        results["runs"].append(r)
        _print_run(r)
        if fl.out:
          with open(fl.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  jax.config.config_with_absl()
  app.run(main)
