"""Which implementation each layer runs in generation: the prefill's FFNs, the decode steps'
FFNs and the decode attention (`Plan`, held by `train.inference.generator.Generator`)."""

from __future__ import annotations

from typing import Sequence

import jax

from train import errors
from train.models import implementations
from train.models import layer_choice as layer_choice_lib

DECODE_FFN = ("auto", "dense", "sparse", "same")
# decode_ffn="auto" runs a layer's FFN sparse at a decode step of at most DECODE_MAX_BATCH rows
# when the features expected to fire in some row of the batch are at most DECODE_UNION_LIMIT
# of H. Measured on an H100 at the paper's 0.5B shape (`benchmarks.decode_ffn`,
# benchmarks/results/h100/decode_ffn.json): the sparse FFN is faster than dense up to a union
# of 0.49 H at 2 rows and 0.51 H at 16 (1.45x at 1-5%, 1.09-1.13x at 50%), and slower at
# every union at 64 rows.
DECODE_UNION_LIMIT = 0.45
DECODE_MAX_BATCH = 16
# Attention at a decode step: "kernel" (`pallas_kernels.decode_attention_triton`: attention and
# the KV-cache write in one kernel per layer), "xla" (`jax.nn.dot_product_attention` and two
# scatters: about ten small kernels per layer), "auto": the kernel where it runs (a GPU, or
# `model.interpret`), supports the heads and the model computes in 16 bits (as measured).
DECODE_ATTENTION = ("auto", "kernel", "xla")


class Plan:
  """The choices of one model here (its `ModelConfig`); `Generator`'s arguments of the same
  names. `active_per_token` may be set after a prefill measured it."""

  def __init__(self, model_cfg, *, prefill_ffn: str | Sequence[str] = "auto",
               active_per_token: Sequence[float] | None = None, decode_ffn: str = "auto",
               decode_attention: str = "auto"):
    if decode_ffn not in DECODE_FFN:
      raise errors.ConfigError(f"decode_ffn={decode_ffn!r} not in {DECODE_FFN}")
    if decode_attention not in DECODE_ATTENTION:
      raise errors.ConfigError(
          f"decode_attention={decode_attention!r} not in {DECODE_ATTENTION}")
    self.model_cfg = model_cfg
    self.prefill_ffn, self.decode_ffn = prefill_ffn, decode_ffn
    self.active_per_token = (None if active_per_token is None
                             else [float(a) for a in active_per_token])
    self.decode_attention = self._attention(decode_attention)

  def _sparse_here(self, tokens: int) -> str:
    """The implementation `None` resolves to for an FFN call of `tokens` rows here."""
    return implementations.implementation(self.model_cfg, tokens, name="auto")

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
    sparse = self._sparse_here(tokens)
    if sparse == "dense" or self.model_cfg.ffn_activation != "relu":
      return ("dense",) * n
    if self.active_per_token is None:
      return None
    return layer_choice_lib.LayerChoice.for_inference(
        self.active_per_token, self.model_cfg.d_ff, sparse=sparse,
        d_model=self.model_cfg.d_model, tokens=tokens).implementations

  def _attention(self, name: str) -> str:
    from pallas_kernels import decode_attention_triton  # pylint: disable=import-outside-toplevel
    mc = self.model_cfg
    why_not = decode_attention_triton.supports(mc.n_heads, mc.n_kv_heads, mc.head_dim)
    if why_not is None and jax.default_backend() != "gpu" and not mc.interpret:
      why_not = f"no GPU (default backend {jax.default_backend()!r}) and model.interpret off"
    if name == "kernel" and why_not is not None:
      raise errors.ConfigError(f"decode_attention='kernel': {why_not}")
    auto = name == "auto" and why_not is None and self._auto_measured()
    return "kernel" if name == "kernel" or auto else "xla"

  def _auto_measured(self) -> bool:
    """The decode kernels' "auto" choices hold where they were measured: 16-bit models."""
    return self.model_cfg.dtype in ("bfloat16", "float16")

  def _decode_runs_here(self) -> str | None:
    """None when the decode kernels run here, else why not."""
    from twell_jax import registry  # pylint: disable=import-outside-toplevel
    return registry.get("decode").unsupported(implementations.call(self.model_cfg, 1, ell_width=1))

  def decode_implementations(self, batch: int, prefill_names,
                             active_per_token: Sequence[float]) -> tuple[str, ...]:
    """Per-layer FFN implementations of the decode steps of `batch` rows: "decode" (the
    few-row sparse kernels) or "dense"; "same" repeats the prefill's. "auto": sparse where
    the kernels run here and the features expected to fire in some row of the batch (from
    each layer's `active_per_token`, rows drawn independently: an overestimate, rows share
    their hot features) are at most DECODE_UNION_LIMIT of H, at batches up to
    DECODE_MAX_BATCH, for 16-bit models (as measured)."""
    mc, n = self.model_cfg, self.model_cfg.n_layers
    if self.decode_ffn == "same":
      return tuple(prefill_names)
    if self.decode_ffn == "dense":
      return ("dense",) * n
    why_not = self._decode_runs_here()
    if self.decode_ffn == "sparse":
      if why_not is not None:
        raise errors.ConfigError(f"decode_ffn='sparse': {why_not}")
      return ("decode",) * n
    if why_not is not None or batch > DECODE_MAX_BATCH or not self._auto_measured():
      return ("dense",) * n
    h = mc.d_ff
    union = [h * (1.0 - (1.0 - min(float(a), h) / h) ** batch) for a in active_per_token]
    return tuple("decode" if u <= DECODE_UNION_LIMIT * h else "dense" for u in union)
