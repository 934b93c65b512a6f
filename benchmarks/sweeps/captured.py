r"""Kernels on captured real activations: per layer, the sparse FFN against XLA dense.

    python -m benchmarks.sweeps.captured --out=captured.json            # on a Hopper GPU
    python -m benchmarks.sweeps.captured --shape=tiny --impl=xla --steps=30 --extreme_steps=10

1. Trains the paper 0.5B shape (D=2048, H=5632, 8 layers) in-process to two levels of FFN
   activity (`benchmarks.common.trained`: paper-like and extreme), cached on the machine's disk.
2. Captures each layer's real FFN input for one held-out batch (8 x 2048 tokens) and its
   weights.
3. Per layer, in one process: the activity statistics (`twell_jax.testing.activity_stats`:
   active per token, dead fraction, top-1% / top-10% shares, hottest feature, row-length
   percentiles), the generator fitted to them (`fit_generator`) and its statistics on as many
   tokens beside them, and the forward and forward + backward of the sparse implementation
   against dense on the captured inputs, with the layer's features sorted by activity and the
   hot ones computed densely (`twell_jax.features.calibrate`), and without that (K 0).
Prints a per-layer table per level and the means; writes everything to --out.
"""

from __future__ import annotations

import json
import math
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from benchmarks.common import specs as specs_lib
from benchmarks.common import timing
from benchmarks.common import trained
from pallas_kernels import reference
import twell_jax as tj
from twell_jax import features as tj_features
from twell_jax import testing

F32 = jnp.float32


def _define_flags():
  flags.DEFINE_string("shape", "paper_0p5b", "model shape: paper_0p5b, or tiny (CPU)")
  flags.DEFINE_list("levels", ["paper", "extreme"], "activity levels (benchmarks.common.trained)")
  flags.DEFINE_integer("steps", 1500, "training steps to the paper-like level")
  flags.DEFINE_integer("extreme_steps", 400, "further steps with the stronger L1")
  flags.DEFINE_string("impl", "mosaic_gpu", "sparse implementation to time")
  flags.DEFINE_integer("iters", 20, "timed calls per measurement")
  flags.DEFINE_list("hot_variants", [], "also time forward and forward + backward with these "
                    "numbers of hot features (multiples of 256)")
  flags.DEFINE_string("cache_dir", trained.DEFAULT_CACHE, "where trained weights are kept")
  flags.DEFINE_string("out", None, "write the results as JSON here")


def capture(cfg, params):
  """(FFN inputs [L, M, D], stacked FFN weights {w_gate, w_up, w_down} [L, ...]) in the
  compute dtype, for one held-out batch of cfg.batch_size x cfg.data.seq_len tokens."""
  from train.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
  from train.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  mc = model_lib.ModelConfig.from_config(cfg.model)
  lm = model_lib.LanguageModel(mc)
  packer = data_lib.PackedBatches(
      data_lib.make_source(cfg.data, cfg.data.eval_split), tokenizer_lib.make_tokenizer(cfg.data),
      seq_len=cfg.data.seq_len, rows=cfg.batch_size, seed=cfg.seed + 1)
  tokens = jnp.asarray(packer.next_batch()[:, :-1])
  xs = jax.jit(lm.ffn_inputs)(params, tokens)
  dt = model_lib.DTYPES[mc.dtype]
  ws = {k: v.astype(dt) for k, v in model_lib.stacked_ffn(params, mc.n_layers).items()}
  return xs.reshape(mc.n_layers, -1, mc.d_model), ws


# How far fit_generator raises the cold tail so that a batch of m tokens still touches the
# captured alive features: until the alive features expected to fire in no row are at most
# _UNSEEN_TARGET of all features, lowering the top-10% share by at most _TAIL_SHARE_BUDGET.
_UNSEEN_TARGET = 0.01
# The popularity anchors fitted (fraction of the features, `activity_stats` key); captures
# made before the top-50% share was recorded fit the first two.
_SHARES = ((0.01, "top1pct_share"), (0.1, "top10pct_share"), (0.5, "top50pct_share"))
_TAIL_SHARE_BUDGET = 0.05


def _row_length_quantiles(q, row_spread: float, probs) -> list[float]:
  """Quantiles of an ordinary row's active count when feature j fires with probability q_j
  over the rows (`twell_jax.testing` model: a log-normal row scale of sigma `row_spread`).

  Given the row's scale the count is a sum of independent Bernoullis (normal approximation
  with a continuity correction); the scale is integrated on a grid.
  """
  values, counts = np.unique(np.asarray(q)[np.asarray(q) > 0], return_counts=True)
  t = testing.gate_thresholds(values, row_spread)
  u = np.linspace(-6.0, 6.0, 241)
  w = np.exp(-0.5 * u * u)
  w /= w.sum()
  p = special.ndtr(-t[None, :] / np.exp(row_spread * u)[:, None])
  mean, sd = p @ counts, np.sqrt((p * (1 - p)) @ counts + 1e-9)
  cdf = lambda x: w @ special.ndtr((x + 0.5 - mean) / sd)
  out = []
  for prob in probs:
    lo, hi = 0.0, float(counts.sum())
    for _ in range(40):
      mid = 0.5 * (lo + hi)
      lo, hi = (mid, hi) if cdf(mid) < prob else (lo, mid)
    out.append(0.5 * (lo + hi))
  return out


def fit_generator(stats: dict, m: int, h: int, extra_shares=()) -> dict:
  """`twell_jax.testing.ffn_inputs` arguments reproducing a layer's activity statistics
  (`testing.activity_stats`) in batches of m tokens, for h features; `extra_shares`: more
  (fraction of the features, share of all actives) anchors past the top 10% measured
  otherwise (e.g. a capture's share of its K hot features).

  * Near-dense rows: one heavy row per m tokens, filling the longest captured row
    (heavy_fill = row_max / alive features). Its firings are taken out of the ordinary rows'
    mean, hottest feature and top shares, so the batch as a whole matches.
  * Popularity: the dead fraction, hottest feature and top-1% / top-10% / top-50% shares
    directly (the top-50% where the statistics have it).
    A captured feature counts as alive when it fired anywhere in the captured batch, often
    only in a near-dense row; when one heavy row would leave many alive features unseen in m
    tokens, the cold tail's rate rises (see _UNSEEN_TARGET).
  * Row spread: minimises the squared log errors of the row-length p50 and p99 that the
    model predicts.
  """
  mu, dead = stats["active_per_token"], stats["dead_fraction"]
  alive = max(1, int(round((1.0 - dead) * h)))
  fill = min(1.0, stats["row_max"] / alive)
  mu_o = max((mu * m - fill * alive) / (m - 1), 0.0)
  hottest = min(1.0, max((stats["hottest_fraction"] * m - fill) / (m - 1), 1e-6))
  # A share of the whole batch as one of the ordinary rows (the heavy row's firings out).
  ordinary = lambda frac, share: [frac, min(1.0, (share * mu * m - fill * min(alive, round(
      frac * h))) / max(mu_o * (m - 1), 1e-9))]
  shares = [ordinary(frac, stats[key]) for frac, key in _SHARES if key in stats]
  shares = shares[:2] + sorted(shares[2:] + [ordinary(f, s) for f, s in extra_shares])
  rates = lambda s10: testing.feature_rates(
      h, mu_o, dead_fraction=dead, hottest=hottest,
      top_shares=(shares[0], (0.1, s10), *shares[2:]))
  unseen = lambda s10: (1.0 - fill) * np.sum(np.exp(-m * rates(s10)[:alive])) / h
  if alive > round(0.1 * h) and unseen(shares[1][1]) > _UNSEEN_TARGET:
    lo, hi = max(shares[0][1], shares[1][1] - _TAIL_SHARE_BUDGET), shares[1][1]
    for _ in range(30):
      mid = 0.5 * (lo + hi)
      lo, hi = (mid, hi) if unseen(mid) <= _UNSEEN_TARGET else (lo, mid)
    shares[1][1] = lo
  args = dict(active_fraction=mu_o / h, dead_fraction=dead, hottest=hottest,
              top_shares=tuple(tuple(a) for a in shares), heavy_fraction=1.0 / m,
              heavy_fill=fill)
  q = testing.feature_rates(h, mu_o, dead_fraction=dead, hottest=hottest,
                            top_shares=args["top_shares"])
  want = np.log1p([stats["row_p50"], stats["row_p99"]])
  err = lambda s: float(np.sum((np.log1p(_row_length_quantiles(q, s, (0.5, 0.99))) - want) ** 2))
  grid = np.linspace(0.0, 2.0, 21)
  best = int(np.argmin([err(s) for s in grid]))
  lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
  golden = (math.sqrt(5.0) - 1.0) / 2.0
  for _ in range(12):
    a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
    lo, hi = (lo, b) if err(a) < err(b) else (a, hi)
  return dict(args, row_spread=0.5 * (lo + hi))


@jax.jit
def _fires(x, w_gate):
  return jnp.dot(x, w_gate, preferred_element_type=F32) > 0


def generated_stats(args: dict, m: int, d: int, h: int) -> dict:
  """`testing.activity_stats` of the gate of `ffn_inputs(key 0, m, d, h, **args)`."""
  x, wg, _, _ = testing.ffn_inputs(jax.random.key(0), m, d, h, **args)
  return testing.activity_stats(np.asarray(_fires(x, wg)))


_JITTED: dict = {}


def _jitted(kind, impl: str, hot: int = 0):
  """One jitted function per measurement kind, implementation and number of hot features,
  reused across layers (one compile each)."""
  key = (kind, impl, hot)
  if key not in _JITTED:
    if kind == "fwd":
      fn = ((lambda *a: reference.dense_ffn_hidden(*a)[0]) if impl == "dense"
            else (lambda *a: tj.ffn(*a, implementation=impl, hot_features=hot)))
    else:
      fn = jax.grad(specs_lib.loss_fn(impl, specs_lib.Spec(kind[1]), hot_features=hot),
                    argnums=(0, 1, 2, 3))
    _JITTED[key] = jax.jit(fn)
  return _JITTED[key]


def time_layer(x, wg, wu, wd, impl: str, iters: int, hot_variants=()) -> dict:
  """Forward and forward + backward, dense and `impl`, on one layer's captured input, with
  the layer's features sorted by their activity on it and the calibrated number of hot
  features (`twell_jax.features.calibrate`: what a model that keeps its features sorted
  runs: the forward at the K of calls that are never differentiated, forward + backward at
  the training K); also without hot features, and with each of `hot_variants`."""
  wg, wu, wd, k = tj_features.calibrate(x, wg, wu, wd)
  # The features are sorted already: this calibration only counts again (same order).
  *_, k_fwd = tj_features.calibrate(x, wg, wu, wd, backward=False)
  out = {"hot_features": k, "forward_hot_features": k_fwd}
  args = (x, wg, wu, wd)
  grad_args = args + (jax.random.normal(jax.random.key(1), x.shape, F32),)
  kind = ("fwd_bwd",) + tuple(x.shape)
  # The dense time does not depend on the data: the smaller of two medians, so that one
  # stall of the host (a dense forward once read 3.98 ms against 1.73-1.88 on the other
  # layers) cannot make a layer look fast.
  dense = lambda f, a: min(timing.wall_ms(f, *a, iters=iters) for _ in range(2))
  out["fwd_dense_ms"] = dense(_jitted("fwd", "dense"), args)
  out["fwd_bwd_dense_ms"] = dense(_jitted(kind, "dense"), grad_args)
  for label, hot in [("", None), ("_k0", 0)] + [(f"_hot{v}", v) for v in hot_variants]:
    for name, kk, f, a, base in (("fwd", k_fwd, "fwd", args, "fwd_dense_ms"),
                                 ("fwd_bwd", k, kind, grad_args, "fwd_bwd_dense_ms")):
      if label and hot == kk:
        continue          # the same as the calibrated run
      ms = timing.wall_ms(_jitted(f, impl, kk if hot is None else hot), *a, iters=iters)
      out[f"{name}{label}_sparse_ms"], out[f"{name}{label}_ratio"] = ms, ms / out[base]
  y = _jitted("fwd", impl, k_fwd)(*args)
  ref, _ = reference.reference_ffn_hidden(*args)
  out["rel_err"] = float(jnp.linalg.norm(y.astype(F32) - ref) / jnp.linalg.norm(ref))
  return out


def run_level(shape: str, level: str, fl) -> dict:
  t0 = time.time()
  cfg, params = trained.trained_params(shape, level, steps=fl.steps,
                                       extreme_steps=fl.extreme_steps, cache_dir=fl.cache_dir)
  t_train = time.time() - t0
  xs, ws = capture(cfg, params)
  n_layers, m, d = xs.shape
  h = ws["w_up"].shape[-1]
  layers = []
  for l in range(n_layers):
    x, wg, wu, wd = xs[l], ws["w_gate"][l], ws["w_up"][l], ws["w_down"][l]
    st = testing.activity_stats(np.asarray(_fires(x, wg)))
    gen_args = fit_generator(st, m, h)
    row = {"layer": l, "captured": st, "generator": gen_args,
           "generated": generated_stats(gen_args, m, d, h),
           **time_layer(x, wg, wu, wd, fl.impl, fl.iters, [int(k) for k in fl.hot_variants])}
    layers.append(row)
    print(f"  {level} layer {l}: active {st['active_per_token']:.1f} dead "
          f"{st['dead_fraction']:.2f} top1%/10% {st['top1pct_share']:.2f}/"
          f"{st['top10pct_share']:.2f} hottest "
          f"{st['hottest_fraction']:.2f} rows p50/p99/max {st['row_p50']:.0f}/"
          f"{st['row_p99']:.0f}/{st['row_max']} | K {row['forward_hot_features']} / "
          f"{row['hot_features']}: fwd {row['fwd_ratio']:.3f} fwd+bwd {row['fwd_bwd_ratio']:.3f}"
          + (f" | K 0: fwd {row['fwd_k0_ratio']:.3f} fwd+bwd {row['fwd_bwd_k0_ratio']:.3f}"
             if "fwd_k0_ratio" in row else ""),
          flush=True)
  mean = lambda k: float(np.mean([r[k] for r in layers]))
  return {"level": level, "shape": shape, "train_or_load_s": round(t_train, 1),
          "layers": layers, "mean_fwd_ratio": mean("fwd_ratio"),
          "mean_fwd_bwd_ratio": mean("fwd_bwd_ratio"),
          "max_fwd_ratio": max(r["fwd_ratio"] for r in layers),
          "max_fwd_bwd_ratio": max(r["fwd_bwd_ratio"] for r in layers)}


def _print_table(results: list[dict]) -> None:
  stat_keys = ("active_per_token", "dead_fraction", "top1pct_share", "top10pct_share",
               "hottest_fraction", "row_p50", "row_p99", "row_max")
  for res in results:
    print(f"\n{res['level']} ({res['shape']}): mean fwd {res['mean_fwd_ratio']:.3f}, "
          f"fwd+bwd {res['mean_fwd_bwd_ratio']:.3f} (worst layer {res['max_fwd_ratio']:.3f} / "
          f"{res['max_fwd_bwd_ratio']:.3f})")
    print(f"{'layer':>5} {'':>9}" + "".join(f"{k[:10]:>11}" for k in stat_keys)
          + f"{'fwd':>8}{'fwd+bwd':>9}")
    for r in res["layers"]:
      for src in ("captured", "generated"):
        vals = "".join(f"{r[src][k]:>11.3g}" for k in stat_keys)
        tail = f"{r['fwd_ratio']:>8.3f}{r['fwd_bwd_ratio']:>9.3f}" if src == "captured" else ""
        print(f"{r['layer']:>5} {src:>9}{vals}{tail}")


def main(argv):
  del argv
  fl = flags.FLAGS
  device = jax.devices()[0].device_kind
  print("device:", device, flush=True)
  results = []
  for level in fl.levels:
    results.append({"device": device, **run_level(fl.shape, level, fl)})
    if fl.out:
      with open(fl.out, "w") as f:
        json.dump(results, f, indent=1)
  _print_table(results)


if __name__ == "__main__":
  _define_flags()
  jax.config.config_with_absl()
  app.run(main)
