r"""End to end: the sparse model against the same model with a dense SiLU FFN, in one process.

    python -m benchmarks.e2e --out=e2e.json                      # on a Hopper GPU
    python -m benchmarks.e2e --shapes=tiny --steps=3 --iters=2   # the CPU smoke mode

Both models are the project's own (`train/models/transformer.py`) at the paper's shapes (D=2048,
H=5632, 32 heads, context 2048, the 32k vocabulary) with the same attention (cuDNN flash
attention on a GPU) and the same LM head (bf16, chunked cross-entropy). Weights are realistic:
the 0.5B shape trained in-process to the paper-like activity (`benchmarks.common.trained`, shared with
the captured-activation benchmark); deeper shapes repeat its 8 trained layers. The sparse model
runs ReLU + L1 with each layer on the sparse kernels or the dense FFN by its measured activity
(`train.models.implementations.replay`: one choice for training, one for inference); the dense model runs SiLU
(the paper's baseline), the same weights.

Measured per shape, as sparse / dense ratios in one process:
  * training tokens/s (8 x 2048 tokens per step, AdamW; median of synchronized steps), each
    model without rematerialization where its step fits in 92% of the device memory, else
    with it (the sparse model's smaller residuals buy the faster choice),
  * peak training memory (XLA's memory analysis of the compiled step),
  * with --profile=<shape>, one step's device time by kind of kernel (attention, GEMMs, sparse FFN
    kernels, other),
  * prefill tokens/s of the backbone at 16 x 2048 and 64 x 2048 tokens (as the paper times),
  * energy per token where NVML reads the board's power (sampled every 50 ms).
Writes the JSON that benchmarks/results/<device>/e2e.json keeps.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import timing
from benchmarks.common import trained

_LAYERS = {"0p5b": 8, "1p5b": 28, "tiny": 2}


def _define_flags():
  flags.DEFINE_list("shapes", ["0p5b", "1p5b"], "0p5b, 1p5b (paper shapes) or tiny (CPU)")
  flags.DEFINE_integer("steps", 1500, "training steps of the paper-like weights (cached)")
  flags.DEFINE_integer("iters", 10, "timed steps / calls per measurement")
  flags.DEFINE_string("sparse", None, "the sparse implementation (default: the one auto "
                     "takes here, train.models.implementations; xla where that is dense)")
  flags.DEFINE_float("sparse_below", None, "per-layer choice threshold on the predicted "
                     "ratio to dense (default: train.models.layer_choice's)")
  flags.DEFINE_string("cache_dir", trained.DEFAULT_CACHE, "where trained weights are kept")
  flags.DEFINE_list("profile", [], "shapes whose training step's device time is broken down "
                    "by kind of kernel (CUPTI; needs a second copy of the state)")
  flags.DEFINE_enum("tokenizer", "byte", ["byte", "python32k"], "byte: the docstring corpus "
                    "and byte tokens; python32k: the Python-source corpus with its 32k "
                    "SentencePiece tokenizer (benchmarks.common.trained.config_for)")
  flags.DEFINE_string("out", None, "write the results as JSON here")


class PowerSampler:
  """Board power (W) every 50 ms through NVML while active; None where NVML is missing."""

  def __init__(self):
    try:
      import pynvml  # pylint: disable=import-outside-toplevel
      pynvml.nvmlInit()
      self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # pylint: disable=broad-except  # no NVML: no energy figures
      self._nvml = None
    self._samples, self._stop = [], threading.Event()

  def __enter__(self):
    if self._nvml is not None:
      self._stop.clear()
      self._samples = []
      self._thread = threading.Thread(target=self._run, daemon=True)
      self._thread.start()
    return self

  def _run(self):
    while not self._stop.is_set():
      self._samples.append(self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3)
      time.sleep(0.05)

  def __exit__(self, *exc):
    if self._nvml is not None:
      self._stop.set()
      self._thread.join()

  @property
  def mean_watts(self) -> float | None:
    return float(np.mean(self._samples)) if self._samples else None


def _timed(fn, args, iters: int, tokens: int) -> dict:
  """Wall time per call of `fn(*args)` (synchronized) with power sampled over the loop."""
  with PowerSampler() as power:
    ms = timing.wall_ms(fn, *args, iters=iters)
  out = {"ms": ms, "tokens_per_s": tokens / ms * 1e3}
  if power.mean_watts is not None:
    out["watts"] = power.mean_watts
    out["joules_per_token"] = power.mean_watts * ms / 1e3 / tokens
  return out


def _config(shape: str, tokenizer: str = "byte"):
  if shape == "tiny":
    return trained.config_for("tiny", tokenizer=tokenizer)
  cfg = trained.config_for("paper_0p5b", tokenizer=tokenizer)
  cfg.model.n_layers = _LAYERS[shape]
  return cfg


def _model(cfg, mc):
  """(LanguageModel, optimizer, jitted train step) of a model config."""
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  from train.state import optim  # pylint: disable=import-outside-toplevel
  from train.state import steps as steps_lib  # pylint: disable=import-outside-toplevel
  lm = model_lib.LanguageModel(mc)
  tx = optim.make_optimizer(cfg)
  return lm, tx, jax.jit(steps_lib.make_train_step(lm, tx, cfg), donate_argnums=0)


def _state(lm, tx, params, n_layers, seed=0):
  from train.state import sparsity  # pylint: disable=import-outside-toplevel
  params = jax.tree.map(jnp.copy, params)      # the step donates its state
  return {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0),
          "rng": jax.random.key_data(jax.random.key(seed)),
          "since": sparsity.init_since(n_layers, lm.cfg.d_ff)}


def _prefill_rows(shape: str) -> tuple[int, ...]:
  return (2,) if shape == "tiny" else (16, 64)


def _memory_limit() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def _time_steps(step, state, batch, iters: int):
  """Synchronized wall ms of each of `iters` training steps after two warm-up steps (the
  median is robust to a step that retraces), and the mean board power over them (or None):
  (ms list, watts, state, metrics)."""
  for _ in range(2):
    state, _ = step(state, batch)
  with PowerSampler() as power:
    ms, state, m = timing.synced_steps_ms(step, state, batch, iters=iters, warmup=0)
  return ms, power.mean_watts, state, m


def _step_profile(label, run_cfg, mc, params, n_layers, batch) -> dict:
  """Device time of one training step by kind of kernel (CUPTI), from a non-donating step."""
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  from train.state import optim  # pylint: disable=import-outside-toplevel
  from train.state import steps as steps_lib  # pylint: disable=import-outside-toplevel
  lm = model_lib.LanguageModel(mc)
  tx = optim.make_optimizer(run_cfg)
  step = jax.jit(steps_lib.make_train_step(lm, tx, run_cfg))
  state = _state(lm, tx, params, n_layers)
  table = timing.kernel_breakdown(step, state, batch, iterations=2)
  if not table:
    return {}
  kinds = timing.by_kind(table)
  out = timing.summarize_breakdown(label, table, top=15)
  out.pop("kernels", None)
  out["by_kind_ms"] = kinds
  out["launches"] = len(table)
  print("    by kind: " + ", ".join(f"{k} {v:.1f} ms" for k, v in kinds.items()), flush=True)
  return out


def _choices(mc_sparse, params, train_batch, fl) -> tuple:
  """The sparse model's per-layer choices (training, inference) from the trained weights'
  measured activity, as the trainer makes them (`train.models.implementations.replay`): its
  hidden features sorted by popularity, the hot ones per layer, each layer's implementation by
  its predicted ratio to dense. Returns (params sorted, training model config, prefill model
  config, result fields)."""
  from train.models import implementations  # pylint: disable=import-outside-toplevel
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  probe = model_lib.LanguageModel(dataclasses.replace(mc_sparse, ffn_implementation="dense"))
  tokens = train_batch[:, :-1]
  _, stats = jax.jit(probe.hidden)(params, tokens)
  active = np.asarray(stats.nnz_per_token)
  sparse = fl.sparse or implementations.sparse_here(mc_sparse, tokens.size) or "xla"
  choice, order, infer = implementations.replay(
      mc_sparse, jax.device_get(stats.feature_counts), tokens.size, sparse=sparse,
      sparse_below=fl.sparse_below)
  params = model_lib.permute_ffn_features(params, jnp.asarray(order))
  mc_train = dataclasses.replace(mc_sparse, ffn_layer_implementations=choice.implementations,
                                 ffn_layer_hot_features=choice.hot_features)
  mc_prefill = dataclasses.replace(mc_sparse, ffn_layer_implementations=infer.implementations,
                                   ffn_layer_hot_features=tuple(choice.hot))
  fields = {"hot_features": list(choice.hot), "active_per_token": [float(a) for a in active],
            "tail_per_token": choice.tail, "predicted_train_ratio": choice.predicted,
            "sparse_layers": choice.describe(),
            "sparse_layers_prefill": infer.describe((infer.implementations, choice.hot))}
  return params, mc_train, mc_prefill, fields


def run_shape(shape: str, fl) -> dict:
  from train.models import implementations  # pylint: disable=import-outside-toplevel
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  base_shape = "tiny" if shape == "tiny" else "paper_0p5b"
  _, params = trained.trained_params(base_shape, "paper", steps=fl.steps,
                                     extreme_steps=0, cache_dir=fl.cache_dir,
                                     tokenizer=fl.tokenizer)
  cfg = _config(shape, fl.tokenizer)
  n_layers = cfg.model.n_layers
  if shape != "tiny":
    params = trained.repeat_layers(params, n_layers)
  mc_sparse = model_lib.ModelConfig.from_config(cfg.model)
  mc_dense = dataclasses.replace(mc_sparse, ffn_activation="silu", ffn_implementation="dense")
  b, t = cfg.batch_size, cfg.data.seq_len
  train_batches = trained.batches(cfg, b, 2)
  res = {"shape": shape, "layers": n_layers, "batch": b, "seq_len": t,
         "attention": implementations.attention(mc_sparse)}
  params, mc_sparse, mc_prefill_sparse, fields = _choices(mc_sparse, params,
                                                          train_batches[0], fl)
  res.update(fields)
  mc_prefill = {"sparse": mc_prefill_sparse, "dense": mc_dense}
  print(f"  {shape}: active/token {' '.join(f'{a:.1f}' for a in res['active_per_token'])}, "
        f"hot features {' '.join(map(str, res['hot_features']))} -> layers "
        f"{res['sparse_layers']} (training), {res['sparse_layers_prefill']} (prefill)",
        flush=True)
  return _measure(shape, fl, cfg, res, params, mc_sparse, mc_dense, mc_prefill, train_batches)


def _measure(shape, fl, cfg, res, params, mc_sparse, mc_dense, mc_prefill, train_batches):
  """Training and prefill of the sparse and the dense model (module docstring), into `res`."""
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  b, t, n_layers = cfg.batch_size, cfg.data.seq_len, cfg.model.n_layers
  tokens = b * t
  limit = _memory_limit()
  for name, mc, l1 in (("sparse", mc_sparse, cfg.l1_coeff), ("dense", mc_dense, 0.0)):
    run_cfg = cfg.copy_and_resolve_references()
    run_cfg.l1_coeff = l1
    batch = train_batches[0][None]
    # Without rematerialization where the step fits (the faster choice), else with it.
    for remat in (False, True):
      mc_run = dataclasses.replace(mc, remat=remat)
      lm, tx, step = _model(run_cfg, mc_run)
      state = _state(lm, tx, params, n_layers)
      peak = timing.peak_bytes(step.lower(state, batch).compile())
      if not remat:
        res[f"{name}_peak_bytes_no_remat"] = peak
      if limit is None or peak <= 0.92 * limit:
        break
      print(f"  {shape} {name}: {peak / 2**30:.1f} GiB without remat > 92% of "
            f"{limit / 2**30:.1f} GiB: remat on", flush=True)
    res[f"{name}_peak_bytes"], res[f"{name}_remat"] = peak, remat
    ms_steps, watts, state, m = _time_steps(step, state, batch, fl.iters)
    ms = float(np.median(ms_steps))
    res[f"{name}_train"] = {"ms_per_step": ms, "ms_per_step_all": ms_steps,
                            "tokens_per_s": tokens / ms * 1e3, "loss": float(m["loss"])}
    if watts is not None:
      res[f"{name}_train"]["joules_per_token"] = watts * ms / 1e3 / tokens
    del state
    if shape in fl.profile:
      res[f"{name}_train_profile"] = _step_profile(f"{shape} {name} step", run_cfg, mc_run,
                                                   params, n_layers, batch)
    # Prefill: the backbone (embedding, blocks, final norm), as the paper times it.
    lm_prefill = model_lib.LanguageModel(mc_prefill[name])
    fwd = jax.jit(lambda p, x, lm=lm_prefill: lm.hidden(p, x)[0])
    for rows in _prefill_rows(shape):
      toks = trained.batches(cfg, rows, 1)[0]
      res[f"{name}_prefill_{rows}x{t}"] = _timed(fwd, (params, toks[:, :-1]), fl.iters,
                                                 rows * t)
    print(f"  {shape} {name}: train {ms:.1f} ms/step (remat {remat}), peak "
          f"{peak / 2**30:.1f} GiB", flush=True)

  res["train_speedup"] = (res["sparse_train"]["tokens_per_s"]
                          / res["dense_train"]["tokens_per_s"])
  res["peak_memory_ratio"] = res["sparse_peak_bytes"] / res["dense_peak_bytes"]
  # At equal settings (both without remat), whatever each model ran with.
  res["peak_memory_ratio_no_remat"] = (res["sparse_peak_bytes_no_remat"]
                                       / res["dense_peak_bytes_no_remat"])
  for rows in _prefill_rows(shape):
    key = f"prefill_{rows}x{t}"
    res[f"prefill_speedup_{rows}x{t}"] = (res[f"sparse_{key}"]["tokens_per_s"]
                                          / res[f"dense_{key}"]["tokens_per_s"])
  if "joules_per_token" in res["dense_train"]:
    res["train_energy_ratio"] = (res["sparse_train"]["joules_per_token"]
                                 / res["dense_train"]["joules_per_token"])
  return res


def main(argv):
  del argv
  fl = flags.FLAGS
  device = jax.devices()[0].device_kind
  print("device:", device, flush=True)
  results = {"device": device, "jax": jax.__version__}
  for shape in fl.shapes:
    results[shape] = run_shape(shape, fl)
    if fl.out:
      with open(fl.out, "w") as f:
        json.dump(results, f, indent=1)
  print(f"\n{'shape':<8}{'train':>8}{'prefill16':>11}{'prefill64':>11}{'memory':>9}  layers")
  for shape in fl.shapes:
    r = results[shape]
    p = [v for k, v in r.items() if k.startswith("prefill_speedup")]
    print(f"{shape:<8}{r['train_speedup']:>8.3f}" + "".join(f"{v:>11.3f}" for v in p)
          + f"{r['peak_memory_ratio']:>9.3f}  {r['sparse_layers']}")


if __name__ == "__main__":
  _define_flags()
  jax.config.config_with_absl()
  app.run(main)
