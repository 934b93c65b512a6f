"""Which FFN and which attention implementation run: the one place that decides, for training,
the config checks, generation and the benchmarks that replay a run's choice.

Words, used the same way by every module that asks:
  implementation        the name of one way to compute a block. An FFN implementation is one
                        of `twell_jax.registry`'s: "dense", "xla", "mosaic_gpu", "decode". An
                        attention implementation is "xla" or "cudnn" in training and prefill
                        (`jax.nn.dot_product_attention`), "kernel" or "xla" at a decode step.
  auto                  this module picks: "auto" in a config field or a flag (None and "" say
                        the same; `twell_jax.ffn` spells it None).
  sparse implementation the FFN implementation a ReLU layer runs where sparse pays.
  layer key             (implementations [L], hot features [L]): each layer's FFN
                        implementation and number of hot features, what a compiled step
                        depends on (`LayerChoice.key`).
  per-layer choice      training's layer key, moving with the measured activity
                        (`train.models.layer_choice.LayerChoice`).
  plan                  generation's layer implementations for the prefill and the decode
                        steps, and its decode attention (`Plan`).

The answers:
  `ffn(model_cfg, tokens)`       every layer's FFN implementation for calls of `tokens` rows:
                                 the configured one, or for auto what `twell_jax.registry.pick`
                                 takes here (the kernels where they run and were measured faster
                                 than dense at this shape, else dense).
  `training(cfg, model_cfg, n)`  a training run's FFN on n devices (`TrainingFFN`): one
                                 implementation for every layer, or the per-layer choice and
                                 the sparse implementation it switches layers to;
                                 `layer_choice` builds that choice, `ffn_problem` says why an
                                 implementation cannot run here (the config checks).
  `inference_choice`, `replay`   the per-layer choice of a forward-only model from measured
                                 activity, and the choices a run makes from measured feature
                                 counts (the benchmarks that replay them).
  `attention(model_cfg)`         training's and prefill's attention; `attention_problem` says
                                 why a configured one cannot run here.
  `Plan`                         generation's plan.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp

from twell_jax import registry
from twell_jax import shape_costs
from train import errors
from train.models import layer_choice as layer_choice_lib

AUTO = (None, "", "auto")
FFN = tuple(registry.IMPLEMENTATIONS)   # "dense", "xla", "mosaic_gpu", "decode"
ATTENTION = ("auto", "xla", "cudnn")
DECODE_FFN = ("auto", "dense", "sparse", "same")
DECODE_ATTENTION = ("auto", "kernel", "xla")
# decode_ffn="auto" runs a layer's FFN sparse at a decode step of at most DECODE_MAX_BATCH rows
# when the features expected to fire in some row of the batch are at most DECODE_UNION_LIMIT
# of H: where the few-row kernels measured faster than dense (`benchmarks.sweeps.decode_ffn`,
# docs/performance.md).
DECODE_UNION_LIMIT = 0.45
DECODE_MAX_BATCH = 16


# ---- the FFN of one call ----

def tokens_per_call(cfg, n_devices: int) -> int:
  """Rows of one FFN call in a train step of `cfg` on `n_devices` devices: a micro-batch's share
  of one device (at least one sequence)."""
  return max(1, cfg.batch_size // cfg.grad_accum_steps // n_devices) * cfg.data.seq_len


def call(model_cfg, tokens: int, *, ell_width: int = 128) -> registry.Call:
  """The `registry.Call` of one FFN call of `model_cfg` (a `train.models.transformer.
  ModelConfig`) on `tokens` rows."""
  return registry.Call(m=tokens, d=model_cfg.d_model, h=model_cfg.d_ff,
                       gated=model_cfg.ffn_gated, dtype=jnp.dtype(model_cfg.dtype),
                       activation=model_cfg.ffn_activation,
                       interpret=bool(model_cfg.interpret), ell_width=ell_width,
                       tail_rows=None)


def ffn(model_cfg, tokens: int, name: str | None = None) -> str:
  """The FFN implementation of a call of `tokens` rows: `name` (default the model's
  `ffn_implementation`), or for auto what `registry.pick` takes here."""
  name = model_cfg.ffn_implementation if name is None else name
  if name not in AUTO:
    return name
  return registry.pick(call(model_cfg, tokens)).name


def ffn_problem(model_cfg, name: str, tokens: int) -> str | None:
  """Why the FFN implementation `name` cannot run calls of `tokens` rows of this model here
  (None: it can)."""
  return registry.get(name).unsupported(call(model_cfg, tokens))


def _shape_terms(model_cfg, sparse: str, tokens: int, mode: str) -> dict:
  """The per-layer cost model's terms at this model's shape: the kernels' measured speed there
  over the paper shape's (`shape_costs.shape_factor`, where the model was fitted) and whether
  they lose to dense there (`registry`: then no layer runs sparse). The measurements are the
  mosaic_gpu kernels' on a GPU; another sparse implementation, or the interpreter (run for
  correctness, not speed), keeps the paper shape's terms."""
  if sparse != "mosaic_gpu" or model_cfg.interpret:
    return {"shape_scale": 1.0, "shape_loses": False}
  c = call(model_cfg, tokens)
  return {"shape_scale": shape_costs.shape_factor(c.d, c.h, c.m, mode),
          "shape_loses": registry.get(sparse).slower(c)}


# ---- training ----

@dataclasses.dataclass(frozen=True)
class TrainingFFN:
  """A training run's FFN: `implementation` in every layer, or with `per_layer` the per-layer
  choice, which starts every layer dense and switches it to `implementation` where sparse
  pays. `field` is the config field that names `implementation` (for errors); `tokens` the
  rows of one FFN call."""
  field: str
  implementation: str
  per_layer: bool
  tokens: int

  def describe(self) -> str:
    if self.per_layer:
      return f"per layer, dense or {self.implementation} (the per-layer choice)"
    return self.implementation


def training(cfg, model_cfg, n_devices: int) -> TrainingFFN:
  """The FFN of a training run of `cfg` on `n_devices` devices. The per-layer choice runs
  when `layer_choice.enabled`, the model's FFN is auto and its gate a ReLU (exact zeros);
  its sparse implementation is `layer_choice.sparse`, or for auto the model's."""
  tokens = tokens_per_call(cfg, n_devices)
  lc = cfg.get("layer_choice")
  per_layer = (lc is not None and lc.enabled and model_cfg.ffn_implementation in AUTO
               and model_cfg.ffn_activation == "relu")
  if per_layer and lc.sparse not in AUTO:
    field, name = "layer_choice.sparse", lc.sparse
  else:
    field, name = "model.ffn_implementation", ffn(model_cfg, tokens)
  return TrainingFFN(field, name, per_layer and name != "dense", tokens)


def layer_choice(cfg, model_cfg, n_devices: int) -> layer_choice_lib.LayerChoice | None:
  """The per-layer choice of a training run (None where `training` says it does not run),
  with the thresholds of config `layer_choice`."""
  run = training(cfg, model_cfg, n_devices)
  if not run.per_layer:
    return None
  lc = cfg.layer_choice
  return layer_choice_lib.LayerChoice(
      model_cfg.n_layers, model_cfg.d_ff, sparse_implementation=run.implementation,
      sparse_below=lc.sparse_below, dense_above=lc.dense_above, column_floor=lc.column_floor,
      hot_menu=layer_choice_lib.parse_hot_menu(lc.get("hot_menu", "")),
      **_shape_terms(model_cfg, run.implementation, run.tokens, "fwd_bwd"))


# ---- forward-only models and replays ----

def inference_choice(model_cfg, tail_per_token, hot_features=None, *, sparse: str,
                     tokens: int) -> layer_choice_lib.LayerChoice:
  """The per-layer choice of a forward-only model with fixed weights, calls of `tokens` rows:
  `sparse` where the forward's predicted ratio is below the inference threshold
  (`LayerChoice.for_inference`). `tail_per_token` [L]: each layer's active features per token
  outside its `hot_features` [L] (default none)."""
  return layer_choice_lib.LayerChoice.for_inference(
      tail_per_token, model_cfg.d_ff, hot_features, sparse_implementation=sparse,
      **_shape_terms(model_cfg, sparse, tokens, "fwd"))


def replay(model_cfg, feature_counts, tokens: int, *, sparse: str,
           sparse_below: float | None = None):
  """The choices a run makes from measured feature counts [L, H] over `tokens` tokens: the
  per-layer choice of training (`LayerChoice.update_from_counts`, one decision) and, with the
  hot features it picked, the prefill's (`inference_choice`). Returns (training choice,
  popularity order [L, H] to sort the features by, inference choice). `sparse_below`
  overrides the training threshold (dense_above follows it where it would fall below)."""
  kw = {}
  if sparse_below is not None:
    kw = dict(sparse_below=sparse_below,
              dense_above=max(sparse_below, layer_choice_lib.DEFAULT_DENSE_ABOVE))
  choice = layer_choice_lib.LayerChoice(
      model_cfg.n_layers, model_cfg.d_ff, sparse_implementation=sparse,
      **_shape_terms(model_cfg, sparse, tokens, "fwd_bwd"), **kw)
  _, order = choice.update_from_counts(feature_counts, tokens)
  infer = inference_choice(model_cfg, choice.tail, choice.hot, sparse=sparse, tokens=tokens)
  return choice, order, infer


def sparse_here(model_cfg, tokens: int) -> str | None:
  """The sparse implementation auto takes here for calls of `tokens` rows, or None (dense)."""
  name = ffn(model_cfg, tokens, name="auto")
  return None if name == "dense" or model_cfg.ffn_activation != "relu" else name


# ---- attention ----

def deterministic_ops() -> bool:
  """Whether XLA's deterministic GPU reductions are asked for (`XLA_FLAGS`)."""
  on = False
  for flag in os.environ.get("XLA_FLAGS", "").split():
    flag_name, _, value = flag.partition("=")
    if flag_name == "--xla_gpu_deterministic_ops":   # the last one counts, as in XLA
      on = value.lower() in ("", "true", "1")
  return on


def attention(model_cfg) -> str:
  """The attention of training and prefill: cuDNN flash attention on a GPU for bf16 / f16 with
  head dims it supports (far faster than XLA's at the paper shape), else XLA's.

  Not under XLA's deterministic ops (`--xla_gpu_deterministic_ops`) where a train step can
  hold several cuDNN attention calls: the loop layout, the scan unrolled, or per-layer FFNs
  (a scan body per group of layers, `ModelConfig.layer_groups`). XLA keys a cuDNN attention
  backward's compiled graph before marking it deterministic, so a second call finds none and
  the step fails at its first run (`IndexError: raw_hash_map<>::at`, jax 0.11.2); one call
  per program, the scan's, runs."""
  if model_cfg.attention != "auto":
    return model_cfg.attention
  several = (not model_cfg.scan_layers or model_cfg.scan_unroll
             or model_cfg.ffn_layer_implementations is not None)
  if deterministic_ops() and several and model_cfg.n_layers > 1:
    return "xla"
  e = model_cfg.d_model // model_cfg.n_heads
  if (jax.default_backend() == "gpu" and model_cfg.dtype in ("bfloat16", "float16")
      and e % 8 == 0 and e <= 128):
    return "cudnn"
  return "xla"


def attention_problem(model_cfg) -> str | None:
  """Why the configured attention cannot run here (None: it can)."""
  if model_cfg.attention == "cudnn" and jax.default_backend() != "gpu":
    return f"needs a GPU (default backend is {jax.default_backend()!r})"
  return None


def _measured_dtype(model_cfg) -> bool:
  """The decode kernels' auto choices hold where they were measured: 16-bit models."""
  return model_cfg.dtype in ("bfloat16", "float16")


def decode_attention_for(model_cfg, name: str = "auto") -> str:
  """A decode step's attention: "kernel" (`pallas_kernels.decode_attention_triton`: attention
  and the KV-cache write in one kernel per layer) or "xla" (`jax.nn.dot_product_attention` and
  two scatters, about ten small kernels per layer). auto: the kernel where it runs (a GPU, or
  `model.interpret`), supports the heads and the model computes in 16 bits."""
  if name not in DECODE_ATTENTION:
    raise errors.ConfigError(f"decode_attention={name!r} not in {DECODE_ATTENTION}")
  from pallas_kernels import decode_attention_triton  # pylint: disable=import-outside-toplevel
  mc = model_cfg
  why_not = decode_attention_triton.supports(mc.n_heads, mc.n_kv_heads, mc.head_dim)
  if why_not is None and jax.default_backend() != "gpu" and not mc.interpret:
    why_not = f"no GPU (default backend {jax.default_backend()!r}) and model.interpret off"
  if name == "kernel" and why_not is not None:
    raise errors.ConfigError(f"decode_attention='kernel': {why_not}")
  auto = name == "auto" and why_not is None and _measured_dtype(mc)
  return "kernel" if name == "kernel" or auto else "xla"


# ---- generation ----

class Plan:
  """Generation's plan for one model (its `ModelConfig`): the prefill's and the decode steps'
  layer implementations and the decode attention; `train.inference.generator.Generator`'s
  arguments of the same names. `active_per_token` may be set after a prefill measured it."""

  def __init__(self, model_cfg, *, prefill_ffn: str | Sequence[str] = "auto",
               active_per_token: Sequence[float] | None = None, decode_ffn: str = "auto",
               decode_attention: str = "auto"):
    if decode_ffn not in DECODE_FFN:
      raise errors.ConfigError(f"decode_ffn={decode_ffn!r} not in {DECODE_FFN}")
    self.model_cfg = model_cfg
    self.prefill_ffn, self.decode_ffn = prefill_ffn, decode_ffn
    self.active_per_token = (None if active_per_token is None
                             else [float(a) for a in active_per_token])
    self.decode_attention = decode_attention_for(model_cfg, decode_attention)

  def prefill_implementations(self, tokens: int) -> tuple[str, ...] | None:
    """Per-layer FFN implementations of a prefill of `tokens` tokens; None: not decided
    yet (auto without a measured activity: this prefill runs dense and measures it)."""
    n = self.model_cfg.n_layers
    if not isinstance(self.prefill_ffn, str):
      names = tuple(self.prefill_ffn)
      if len(names) != n:
        raise errors.ConfigError(f"prefill_ffn has {len(names)} names for {n} layers")
      return names
    if self.prefill_ffn != "auto":
      return (self.prefill_ffn,) * n
    sparse = sparse_here(self.model_cfg, tokens)
    if sparse is None:
      return ("dense",) * n
    if self.active_per_token is None:
      return None
    return inference_choice(self.model_cfg, self.active_per_token, sparse=sparse,
                            tokens=tokens).implementations

  def decode_implementations(self, batch: int, prefill_names,
                             active_per_token: Sequence[float]) -> tuple[str, ...]:
    """Per-layer FFN implementations of the decode steps of `batch` rows: "decode" (the
    few-row sparse kernels) or "dense"; "same" repeats the prefill's. auto: sparse where the
    kernels run here and the features expected to fire in some row of the batch (from each
    layer's `active_per_token`, rows drawn independently: an overestimate, rows share their
    hot features) are at most DECODE_UNION_LIMIT of H, at batches up to DECODE_MAX_BATCH,
    for 16-bit models (as measured)."""
    mc, n = self.model_cfg, self.model_cfg.n_layers
    if self.decode_ffn == "same":
      return tuple(prefill_names)
    if self.decode_ffn == "dense":
      return ("dense",) * n
    why_not = registry.get("decode").unsupported(call(mc, 1, ell_width=1))
    if self.decode_ffn == "sparse":
      if why_not is not None:
        raise errors.ConfigError(f"decode_ffn='sparse': {why_not}")
      return ("decode",) * n
    if why_not is not None or batch > DECODE_MAX_BATCH or not _measured_dtype(mc):
      return ("dense",) * n
    h = mc.d_ff
    union = [h * (1.0 - (1.0 - min(float(a), h) / h) ** batch) for a in active_per_token]
    return tuple("decode" if u <= DECODE_UNION_LIMIT * h else "dense" for u in union)
