r"""Where inference time goes on trained weights: the prefill of both models and each layer's
sparse FFN forward, kernel by kernel (CUPTI), plus each layer's feature popularity.

    python -m benchmarks.probes.forward_profile --out=forward_profile.json   # Hopper GPU

1. The paper 0.5B shape trained to the paper-like level (`benchmarks.common.trained`, cached).
2. Prefill (backbone) of the sparse model (per-layer inference choice) and the dense SiLU
   model at --rows x 2048 tokens: wall ms and device time by kind of kernel, top kernels.
3. Per layer, on its captured FFN input: how many features fire on more than 0.5 / 1 / 2 / 5 /
   10% of the tokens and the share of all active entries they hold (what a dense block of
   the hottest features takes off the gathers), and the sparse forward's kernels with the
   features sorted and the calibrated hot features (`twell_jax.features.calibrate`).
Both prefills run with the sparse model's features sorted and its hot features per layer.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.sweeps import captured
from benchmarks.common import timing
from benchmarks.common import trained
from pallas_kernels import ffn_mgpu
from twell_jax import features as tj_features

_THRESHOLDS = (0.005, 0.01, 0.02, 0.05, 0.1)


def _define_flags():
  flags.DEFINE_integer("steps", 1500, "training steps of the paper-like weights (cached)")
  flags.DEFINE_integer("rows", 16, "prefill sequences of 2048 tokens")
  flags.DEFINE_integer("iters", 10, "timed calls per measurement")
  flags.DEFINE_string("cache_dir", trained.DEFAULT_CACHE, "where trained weights are kept")
  flags.DEFINE_string("out", None, "write the results as JSON here")


def _profile(label: str, fn, *args, iters: int) -> dict:
  out = {"wall_ms": timing.wall_ms(fn, *args, iters=iters)}
  table = timing.kernel_breakdown(fn, *args, iterations=3)
  out.update(timing.summarize_breakdown(label, table, top=15))
  out["by_kind_ms"] = timing.by_kind(table)
  out.pop("kernels", None)
  print(f"  {label}: wall {out['wall_ms']:.2f} ms; " + ", ".join(
      f"{k} {v:.2f}" for k, v in out["by_kind_ms"].items()), flush=True)
  return out


def popularity(x, w_gate) -> dict:
  """Features above each firing-rate threshold and the share of active entries they hold."""
  counts = np.asarray(jax.jit(
      lambda a, b: jnp.sum((jnp.dot(a, b, preferred_element_type=jnp.float32) > 0)
                           .astype(jnp.int32), axis=0))(x, w_gate))
  m, total = x.shape[0], max(int(counts.sum()), 1)
  out = {"active_per_token": float(counts.sum() / m)}
  for t in _THRESHOLDS:
    hot = counts > t * m
    out[f"above_{t:g}"] = {"features": int(hot.sum()),
                           "entry_share": float(counts[hot].sum() / total)}
  return out


def main(argv):
  del argv
  fl = flags.FLAGS
  from train.models import implementations  # pylint: disable=import-outside-toplevel
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  res = {"device": jax.devices()[0].device_kind}
  cfg, params = trained.trained_params("paper_0p5b", "paper", steps=fl.steps, extreme_steps=0,
                                       cache_dir=fl.cache_dir)
  xs, ws = captured.capture(cfg, params)
  layers = []
  for l in range(xs.shape[0]):
    pop = popularity(xs[l], ws["w_gate"][l])
    *w, k = tj_features.calibrate(xs[l], ws["w_gate"][l], ws["w_up"][l], ws["w_down"][l])
    pop["hot_features"] = k
    fwd_cfg = ffn_mgpu.ForwardConfig(hot_features=k)
    fwd = jax.jit(lambda *a, c=fwd_cfg: ffn_mgpu.ffn_forward(*a, config=c)[0])
    pop["forward"] = _profile(f"layer {l} sparse forward (K {k})", fwd, xs[l], *w,
                              iters=fl.iters)
    layers.append(pop)
    print(f"  layer {l}: " + json.dumps({k: v for k, v in pop.items() if k != "forward"}),
          flush=True)
  res["layers"] = layers

  mc = model_lib.ModelConfig.from_config(cfg.model)
  toks = jnp.concatenate([b[:, :-1] for b in trained.batches(cfg, fl.rows, 1)])
  probe = model_lib.LanguageModel(dataclasses.replace(mc, ffn_implementation="dense"))
  stats = jax.jit(probe.hidden)(params, toks)[1]
  # The trainer's decision and the prefill's from this activity (as `benchmarks.e2e` replays it).
  choice, order, infer = implementations.replay(mc, jax.device_get(stats.feature_counts),
                                                toks.size, sparse="mosaic_gpu")
  params = model_lib.permute_ffn_features(params, jnp.asarray(order))
  hot, tail = choice.hot, choice.tail
  models = {"sparse": dataclasses.replace(mc, ffn_layer_implementations=infer.implementations,
                                          ffn_layer_hot_features=tuple(hot)),
            "dense": dataclasses.replace(mc, ffn_activation="silu", ffn_implementation="dense")}
  for name, m in models.items():
    lm = model_lib.LanguageModel(m)
    fwd = jax.jit(lambda p, x, lm=lm: lm.hidden(p, x)[0])
    res[f"{name}_prefill"] = _profile(f"{name} prefill", fwd, params, toks, iters=fl.iters)
  res["sparse_layers_prefill"] = infer.describe()
  res["hot_features"], res["tail_per_token"] = list(hot), tail
  if fl.out:
    with open(fl.out, "w") as f:
      json.dump(res, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  jax.config.config_with_absl()
  app.run(main)
