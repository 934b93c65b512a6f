r"""The sparse FFN at moderate activity, on the activity of a run from random initialisation.

    python -m benchmarks.sweeps.activity_sweep --out=activity_sweep.json   # on a Hopper GPU
    python -m benchmarks.sweeps.activity_sweep --smoke --out=/tmp/a.json   # CPU smoke mode

1. Trains the paper 0.5B shape from random initialisation through the trainer
   (`train.training.loop.train_and_evaluate`, the per-layer FFN choice on; the setting of
   `benchmarks.whole_run`: Python-source corpus, 32k tokenizer, 8 x 2048 tokens a step, L1
   3e-5) and, at each of `--capture_steps` (decision steps of the per-layer choice), captures
   every layer's FFN input on a held-out batch and its weights (a trainer hook).
2. Per captured layer: its activity statistics (`twell_jax.testing.activity_stats`), the
   per-layer choice on this batch (`train.models.layer_choice.LayerChoice`: the layer's K, its
   predicted ratio) and the layer's forward + backward on the kernels at that K against the
   dense FFN, on the captured input: with the features in the state's order (as trained) and
   sorted by this batch's counts (`sorted`, the prediction's assumption), each with the work
   left to the backward's column kernels (`tail_columns`: the longest column in fair shares);
   `--profile_captures` lists chosen layers kernel by kernel.
3. The sweep: the skew of an early layer (`--early`: step and layer) and of the last layer at
   the last capture, fitted by `benchmarks.sweeps.captured.fit_generator` and generated at each of
   `--actives` active features per token; per point the K the per-layer choice picks
   (`train.models.layer_choice.LayerChoice`), the rows over the ELL width, forward + backward
   against dense.
4. With `--skews_from`, steps 1-2 are skipped: the sweep runs on the fitted skews of an
   earlier result. `--scan_hot` times more K at every last-layer point, each beside its
   bytes-and-FLOPs floor (`floor_ms`); at `--profile_active` the last layer's sparse and dense
   forward + backward are listed kernel by kernel (CUPTI).
5. Every sweep point's floors over dense's nine GEMMs (`best_floors`): the kernels' method at
   its best K and dense rows, any method on non-zero 128 x 128 tiles, and the FLOPs of the
   active entries alone. `--floors` computes them without timing anything (a CPU will do):
   `python -m benchmarks.sweeps.activity_sweep --floors --skews_from=benchmarks/results/h200/activity_sweep.json`.
Times: medians of synchronized calls (`benchmarks.common.timing.wall_ms`), the loss
sum(y * ct) + 2e-5 * l1 of `benchmarks.kernels`. JSON (`--out`): {"device", "captures":
[{"step", "layers": [...]}], "sweep": [{"skew", "active", "hot_features", "ratio", ...}]}.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.sweeps import captured
from benchmarks.common import specs
from benchmarks.common import timing
from benchmarks.common import trained
import twell_jax as tj
from twell_jax import features as tj_features
from twell_jax import testing

F32 = jnp.float32


def _define_flags():
  flags.DEFINE_string("out", None, "results JSON")
  flags.DEFINE_bool("smoke", False, "CPU smoke mode: tiny shape, byte tokenizer, xla")
  flags.DEFINE_integer("steps", 2500, "training steps of the run (its schedule's length)")
  flags.DEFINE_list("capture_steps", ["100", "200", "300", "500", "1000", "1500", "2500"],
                    "steps whose activity is captured (multiples of layer_choice.every)")
  flags.DEFINE_bool("stop_at_last_capture", False, "end the run after the last capture step "
                    "(the schedule stays --steps long): the captures alone, sooner")
  flags.DEFINE_list("actives", ["50", "100", "200", "400", "800"],
                    "active features per token of the sweep")
  flags.DEFINE_string("early", "300:4", "step:layer whose skew is the early steps'")
  flags.DEFINE_string("tokenizer", "python32k", "python32k or byte (benchmarks.common.trained)")
  flags.DEFINE_float("l1", 3e-5, "L1 coefficient of the run")
  flags.DEFINE_integer("iters", 10, "timed calls per measurement")
  flags.DEFINE_string("impl", "mosaic_gpu", "sparse implementation")
  flags.DEFINE_string("skews_from", None, "an earlier result's JSON: sweep its fitted skews, "
                      "without the training run and its captures")
  flags.DEFINE_bool("floors", False, "the sweep's floors (`best_floors`) only, nothing timed: "
                    "runs on a CPU with --skews_from")
  flags.DEFINE_list("scan_hot", [], "more K (hot features) timed at every last-layer point")
  flags.DEFINE_float("profile_active", 200, "the last layer's point listed kernel by kernel "
                     "(0: none)")
  flags.DEFINE_list("profile_captures", ["300:1", "300:5"], "captured layers (step:layer) "
                    "listed kernel by kernel at the choice's K (CUPTI)")


# An H100's measured ceilings (docs/performance.md, "The machine's two ceilings"): XLA's bf16
# GEMM, and random D-long bf16 rows read from L2.
GEMM_FLOP_PER_S = 797e12
ROW_BYTES_PER_S = 7.86e12
# D-long row reads per entry outside the hot features, forward + backward: W_up and W_down
# rows (forward), a dy row (dh, du, dg, dW_down), an x row (dW_up, dW_gate), W_up and W_gate
# rows (dx): `pallas_kernels.ffn_train_mgpu`.
ROW_PASSES = 6


def floor_ms(m: int, d: int, h: int, hot: int, tail_per_token: float) -> float:
  """The least time forward + backward can take on the kernels' method, from bytes and FLOPs
  alone: the gate GEMM (2 M D H FLOPs), the hot features' eight GEMMs (2 M D K each: up and
  down forward, and dh, dW_down, dW_up, dW_gate, dx through up and gate), and `ROW_PASSES`
  D-long bf16 row reads per entry outside them, at the ceilings above. Dense is nine GEMMs of
  2 M D H."""
  gemm_s = 2 * m * d * (h + 8 * hot) / GEMM_FLOP_PER_S
  rows_s = ROW_PASSES * m * tail_per_token * d * 2 / ROW_BYTES_PER_S
  return (gemm_s + rows_s) * 1e3


def best_floors(active: np.ndarray, d: int, step: int = 128, block: int = 128) -> dict:
  """The least forward + backward time over dense's nine GEMMs, from bytes and FLOPs alone, of
  an activity mask [M, H] (features sorted by count), three ways:

  * `kernels`: this library's method at its best setting: the gate GEMM, K hot features as
    eight GEMMs, and per token the cheaper of its entries outside K as `ROW_PASSES` row reads
    each (`floor_ms`) or its non-hot features as dense rows (eight GEMM rows of H - K): the
    hybrid's overflow path. Searched over K in multiples of `step`.
  * `blocks`: any tensor-core method that skips all-zero [block x block] tiles of the token x
    feature matrix: the gate GEMM and eight GEMMs over the non-zero tiles' share.
  * `entries`: the FLOP floor of any exact method: the gate GEMM and eight D-long products per
    active entry, all at the GEMM rate (no gather costs anything).
  """
  m, h = active.shape
  gemm = 2 * d / GEMM_FLOP_PER_S          # seconds per token per feature-GEMM column
  row = ROW_PASSES * d * 2 / ROW_BYTES_PER_S   # seconds per entry outside K
  dense_s = 9 * gemm * m * h
  # Entries per token beyond each K of the grid (features are sorted: a suffix sum).
  ks = list(range(0, h, step)) + [h]
  per_block = np.add.reduceat(active, list(range(0, h, step)), axis=1).astype(np.int64)
  beyond = np.concatenate([np.cumsum(per_block[:, ::-1], axis=1)[:, ::-1],
                           np.zeros((m, 1), np.int64)], axis=1)     # [M, len(ks)]
  best = None
  for j, k in enumerate(ks):
    per_token = np.minimum(beyond[:, j] * row, 8 * gemm * (h - k))
    total = gemm * m * (h + 8 * k) + per_token.sum()
    if best is None or total < best[0]:
      best = (total, k, int(np.sum(beyond[:, j] * row > 8 * gemm * (h - k))))
  mb, hb = -(-m // block), -(-h // block)
  padded = np.zeros((mb * block, hb * block), bool)
  padded[:m, :h] = active
  tiles = padded.reshape(mb, block, hb, block).any(axis=(1, 3)).mean()
  entries = float(active.sum())
  return {"kernels": {"ratio": best[0] / dense_s, "hot_features": best[1], "dense_rows": best[2]},
          "blocks": {"ratio": (1 + 8 * tiles) / 9, "block": block, "nonzero_tiles": float(tiles)},
          "entries": {"ratio": (m * h + 8 * entries) / (9 * m * h)},
          "row_over_gemm": row / (8 * gemm)}


def _block_desc(floors: dict) -> str:
  """The tile bound of `best_floors`, in words."""
  b = floors["blocks"]
  return (f"{b['block']}x{b['block']} tiles {b['ratio']:.3f} ({100 * b['nonzero_tiles']:.0f}% "
          f"non-zero)")


_GRADS: dict = {}


def _grad(impl: str, hot: int, shape):
  """The jitted forward + backward of `benchmarks.common.specs.loss_fn` per implementation and K
  (one compile each, shared by the layers)."""
  if (impl, hot) not in _GRADS:
    spec = specs.Spec(*shape)
    _GRADS[impl, hot] = jax.jit(jax.grad(specs.loss_fn(impl, spec, hot_features=hot),
                                         argnums=(0, 1, 2, 3)))
  return _GRADS[impl, hot]


def time_call(x, wg, wu, wd, hot: int, impl: str, iters: int, dense_ms=None) -> dict:
  """Forward + backward of `impl` with `hot` hot features and of the dense FFN on these
  inputs (or `dense_ms`, measured before on them): ms each and their ratio, waited for call by
  call (`ratio`: the smaller of two medians each, as the host's timing moves a single median
  by a few percent) and back to back (`pipelined_ratio`: launches overlap the GPU's work, as in
  a training step of many layers); and the rows that left the sparse kernels."""
  ct = jax.random.normal(jax.random.key(1), x.shape, F32)
  shape = (x.shape[0], x.shape[1], wu.shape[1])
  args = (x, wg, wu, wd, ct)
  wall = lambda f: min(timing.wall_ms(f, *args, iters=iters) for _ in range(2))
  dense_f, sparse_f = _grad("dense", 0, shape), _grad(impl, hot, shape)
  if dense_ms is None:
    dense_ms = (wall(dense_f), timing.pipelined_ms(dense_f, *args, iters=iters))
  sparse_ms = (wall(sparse_f), timing.pipelined_ms(sparse_f, *args, iters=iters))
  _, st = jax.jit(lambda *a: tj.ffn(*a, implementation=impl, return_stats=True,
                                    hot_features=hot))(x, wg, wu, wd)
  return {"hot_features": hot, "dense_ms": dense_ms[0], "sparse_ms": sparse_ms[0],
          "ratio": sparse_ms[0] / dense_ms[0], "dense_pipelined_ms": dense_ms[1],
          "sparse_pipelined_ms": sparse_ms[1], "pipelined_ratio": sparse_ms[1] / dense_ms[1],
          "overflow_rows": int(st.overflow_rows)}


def _rows_over(active: np.ndarray, hot: int, width: int = 128) -> int:
  """Rows with more than `width` actives outside the first `hot` features."""
  return int(np.sum(active[:, hot:].sum(axis=1) > width))


def _heavy_by_hot(active: np.ndarray) -> np.ndarray:
  """`FFNStats.heavy_rows_by_hot` of an activity mask [M, H] (features in their order)."""
  from twell_jax import stats  # pylint: disable=import-outside-toplevel
  return np.asarray(stats.tile_stats(jnp.asarray(active))[3])


def tail_columns(active: np.ndarray, hot: int) -> dict:
  """The work the column kernels get outside the first `hot` features of an activity mask
  [M, H] in its feature order: entries per token, and the longest such column over a fair
  share (those entries over `twell_jax.features.PARALLEL_COLUMNS` CTAs): with one CTA per
  column, a column many shares long set the kernel's time on its own (the kernels cut such
  columns into pieces: `pallas_kernels.sparse_backward_mgpu.column_pieces`)."""
  cols = active[:, hot:].sum(axis=0)
  entries = int(cols.sum())
  share = max(entries / tj_features.PARALLEL_COLUMNS, 1.0)
  longest = int(cols.max(initial=0))
  return {"tail_per_token": entries / active.shape[0], "longest_tail_column": longest,
          "longest_over_share": longest / share}


def _choice(active: np.ndarray):
  """The per-layer choice for one layer of this activity [M, H] (its features sorted): (its
  implementation, K, predicted ratio, active features per token outside the K hot ones)."""
  from train.models import layer_choice  # pylint: disable=import-outside-toplevel
  m, h = active.shape
  choice = layer_choice.LayerChoice(1, h)
  choice.update_from_counts(active.sum(axis=0)[None], m, _heavy_by_hot(active)[None])
  return choice.implementations[0], choice.hot[0], choice.predicted[0], choice.tail[0]


class _CapturesDone(Exception):
  """Raised by ``Capture`` after the last capture step when the run should end there."""


class Capture:
  """A trainer hook: at the capture steps, every layer's activity and kernel times."""

  def __init__(self, cfg, steps, impl: str, iters: int, profile=(), stop_after_last=False):
    self.cfg, self.steps, self.impl, self.iters = cfg, set(steps), impl, iters
    self.stop_after_last, self.last_step = stop_after_last, 0
    self.profile = set(profile)   # (step, layer) listed kernel by kernel
    self.results, self.fits = [], {}

  def __call__(self, tr, step: int, state, layer_key) -> None:
    self.last_step = step
    if step not in self.steps:
      return
    t0 = time.time()
    dense_cfg = self.cfg.copy_and_resolve_references()
    dense_cfg.model.ffn_implementation = "dense"
    xs, ws = captured.capture(dense_cfg, state["params"])
    layers = []
    for l in range(xs.shape[0]):
      x, wg, wu, wd = xs[l], ws["w_gate"][l], ws["w_up"][l], ws["w_down"][l]
      active = np.asarray(captured._fires(x, wg))   # pylint: disable=protected-access
      st = testing.activity_stats(active)
      # The choice on this batch (the trainer's runs from its own step's batch, later).
      name, k, predicted, tail = _choice(active)
      row = {"layer": l, "captured": st, "rows_over_width": _rows_over(active, k),
             "choice": name, "predicted": predicted, "tail_per_token": tail,
             "trainer_ran": None if layer_key is None else [layer_key[0][l], layer_key[1][l]],
             # As trained: the features in the state's order (sorted at the last decision by
             # the training batches' counts), K the choice's on this batch's sorted counts.
             "as_ordered": tail_columns(active, k),
             **time_call(x, wg, wu, wd, k, self.impl, self.iters)}
      # The same K with the features sorted by this batch's own counts (the prediction's
      # assumption): what the order costs, apart from the kernels.
      swg, swu, swd, order = tj_features.sort_features(wg, wu, wd,
                                                       jnp.asarray(active.sum(axis=0)))
      order = np.asarray(order)
      sorted_time = time_call(x, swg, swu, swd, k, self.impl, self.iters,
                              dense_ms=(row["dense_ms"], row["dense_pipelined_ms"]))
      row["sorted"] = {**tail_columns(active[:, order], k),
                       "sparse_ms": sorted_time["sparse_ms"], "ratio": sorted_time["ratio"],
                       "pipelined_ratio": sorted_time["pipelined_ratio"]}
      if (step, l) in self.profile:
        row["profile"] = _profile(x, wg, wu, wd, k, self.impl)
      self.fits[(step, l)] = captured.fit_generator(st, x.shape[0], wu.shape[1])
      layers.append(row)
      print(f"  step {step} layer {l}: active {st['active_per_token']:.1f} rows p50/p99/max "
            f"{st['row_p50']:.0f}/{st['row_p99']:.0f}/{st['row_max']} K {k} rows over W "
            f"{row['rows_over_width']}: fwd+bwd {row['ratio']:.3f} ({row['sparse_ms']:.2f} / "
            f"{row['dense_ms']:.2f} ms; predicted {predicted:.3f}; sorted by this batch "
            f"{row['sorted']['ratio']:.3f}; longest tail column "
            f"{row['as_ordered']['longest_over_share']:.0f} / "
            f"{row['sorted']['longest_over_share']:.0f} shares)", flush=True)
    self.results.append({"step": step, "seconds": round(time.time() - t0, 1),
                         "layers": layers})
    if self.stop_after_last and step == max(self.steps):
      raise _CapturesDone()


def _profile(x, wg, wu, wd, hot: int, impl: str) -> dict:
  """The sparse (K = `hot`) and the dense forward + backward kernel by kernel (CUPTI; empty
  where it is unavailable)."""
  ct = jax.random.normal(jax.random.key(1), x.shape, F32)
  shape = (x.shape[0], x.shape[1], wu.shape[1])
  return {name: timing.summarize_breakdown(
              f"{name} forward + backward", timing.kernel_breakdown(_grad(i, k, shape),
                                                                    x, wg, wu, wd, ct))
          for name, i, k in (("sparse", impl, hot), ("dense", "dense", 0))}


def sweep_point(skew: str, fit: dict, active: float, shape, impl: str, iters: int,
                scan_hot=(), profile: bool = False, timed: bool = True) -> dict:
  """The fitted skew at `active` features per token: the per-layer choice's K on it, the
  floors of `best_floors`, and (if `timed`) forward + backward against dense; each K of
  `scan_hot` too (`k_scan`, with the floor of `floor_ms`), and the kernels at the choice's K if
  `profile`."""
  m, d, h = shape
  scale = active / max(fit["active_fraction"] * h, 1e-9)
  args = dict(fit, active_fraction=min(1.0, fit["active_fraction"] * scale))
  x, wg, wu, wd = testing.ffn_inputs(jax.random.key(3), m, d, h, **args)
  fires = captured._fires(x, wg)   # pylint: disable=protected-access
  counts = jnp.sum(fires, axis=0, dtype=jnp.int32)
  wg, wu, wd, order = tj_features.sort_features(wg, wu, wd, counts)
  active_mask = np.asarray(jnp.take(fires, order, axis=1))
  name, k, predicted, tail = _choice(active_mask)
  st = testing.activity_stats(active_mask)
  floors = best_floors(active_mask, d)
  out = {"skew": skew, "active": float(active), "generated": st, "choice": name,
         "rows_over_width": _rows_over(active_mask, k), "predicted": predicted,
         "tail_per_token": tail, "hot_features": k, "floors": floors}
  print(f"  {skew} at {active:g}: floors over dense's: the kernels "
        f"{floors['kernels']['ratio']:.3f} (K {floors['kernels']['hot_features']}, "
        f"{floors['kernels']['dense_rows']} dense rows), {_block_desc(floors)}, entries "
        f"{floors['entries']['ratio']:.3f}", flush=True)
  if not timed:
    return out
  out.update(time_call(x, wg, wu, wd, k, impl, iters))
  print(f"  {skew} at {active:g}: measured {st['active_per_token']:.1f} active, rows "
        f"p50/p99/max {st['row_p50']:.0f}/{st['row_p99']:.0f}/{st['row_max']}, K {k} "
        f"(predicted {out['predicted']:.2f}), rows over W {out['rows_over_width']}: fwd+bwd "
        f"{out['ratio']:.3f} ({out['pipelined_ratio']:.3f} back to back)", flush=True)
  scan = []
  for hot in sorted(set(scan_hot) | {k}):
    hot = min(hot, h)
    t = float(active_mask[:, hot:].sum()) / m
    row = (dict(out) if hot == k else
           time_call(x, wg, wu, wd, hot, impl, iters,
                     dense_ms=(out["dense_ms"], out["dense_pipelined_ms"])))
    row = {"hot_features": hot, "tail_per_token": t, "ratio": row["ratio"],
           "pipelined_ratio": row["pipelined_ratio"],
           "sparse_ms": row["sparse_ms"], "rows_over_width": _rows_over(active_mask, hot),
           "floor_ratio": floor_ms(m, d, h, hot, t) / out["dense_ms"]}
    scan.append(row)
    if scan_hot:
      print(f"    K {hot}: {t:.1f} active per token outside, rows over W "
            f"{row['rows_over_width']}: fwd+bwd {row['ratio']:.3f} (floor "
            f"{row['floor_ratio']:.3f})", flush=True)
  if scan_hot:
    out["k_scan"] = scan
  out["floor_ratio"] = next(r["floor_ratio"] for r in scan if r["hot_features"] == min(k, h))
  if profile:
    out["profile"] = _profile(x, wg, wu, wd, k, impl)
  return out


def saved_skews(path: str) -> dict:
  """The fitted skews ({"early", "last_layer"}: {"fit", "from"}) of an earlier result's JSON;
  ValueError naming the file when it has none."""
  with open(path) as f:
    skews = json.load(f).get("skews")
  if not skews or not all("fit" in skew for skew in skews.values()):
    raise ValueError(f"{path} holds no fitted skews (an activity_sweep result with captures "
                     f"has them under \"skews\")")
  return skews


def _train_and_capture(cfg, steps, impl: str, fl) -> dict:
  """Steps 1-2 of the module docstring: {"steps" (trained), "schedule_steps", "run_s",
  "captures", "skews"}."""
  from train.training import loop as train_lib  # pylint: disable=import-outside-toplevel
  hook = Capture(cfg, steps, impl, fl.iters,
                 [tuple(int(v) for v in p.split(":")) for p in fl.profile_captures],
                 stop_after_last=fl.stop_at_last_capture)
  t0 = time.time()
  with tempfile.TemporaryDirectory() as wd:
    try:
      train_lib.train_and_evaluate(cfg, wd, hooks=[hook])
    except _CapturesDone:
      pass
  early_step, early_layer = (int(v) for v in fl.early.split(":"))
  last = max(step for step, _ in hook.fits)
  n_layers = max(l for _, l in hook.fits) + 1
  skews = {"early": hook.fits.get((early_step, early_layer)),
           "last_layer": hook.fits[(last, n_layers - 1)]}
  return {"steps": hook.last_step, "schedule_steps": cfg.num_train_steps,
          "run_s": round(time.time() - t0, 1), "captures": hook.results,
          "skews": {name: {"fit": fit, "from": (f"step {early_step} layer {early_layer}"
                                                if name == "early" else
                                                f"step {last} layer {n_layers - 1}")}
                    for name, fit in skews.items() if fit is not None}}


def main(argv):
  del argv
  fl = flags.FLAGS
  shape_name = "tiny" if fl.smoke else "paper_0p5b"
  impl = "xla" if fl.smoke else fl.impl
  cfg = trained.config_for(shape_name, tokenizer="byte" if fl.smoke else fl.tokenizer)
  steps = [int(s) for s in fl.capture_steps]
  cfg.update(num_train_steps=max(fl.steps, *steps), log_every=50, l1_coeff=fl.l1)
  cfg.model.ffn_implementation = None
  if fl.smoke:
    # Smoke runs end at the last capture; with --stop_at_last_capture on a longer schedule.
    cfg.update(num_train_steps=max(fl.steps if fl.stop_at_last_capture else 0, *steps),
               log_every=2)
    cfg.layer_choice.update(sparse="xla", every=2)
  device = jax.devices()[0].device_kind
  print("device:", device, flush=True)
  mc = cfg.model
  shape = (cfg.batch_size * cfg.data.seq_len, mc.d_model, mc.d_ff)
  results = {"device": device, "jax": jax.__version__, "l1": fl.l1}
  if fl.skews_from:
    results["skews"], results["skews_from"] = saved_skews(fl.skews_from), fl.skews_from
  else:
    results.update(_train_and_capture(cfg, steps, impl, fl))
  scan = [int(k) for k in fl.scan_hot]
  results["sweep"] = [
      sweep_point(name, skew["fit"], float(a), shape, impl, fl.iters,
                  scan_hot=scan if name == "last_layer" else (),
                  profile=name == "last_layer" and float(a) == fl.profile_active,
                  timed=not fl.floors)
      for name, skew in results["skews"].items() for a in fl.actives]
  if fl.out:
    os.makedirs(os.path.dirname(os.path.abspath(fl.out)), exist_ok=True)
    with open(fl.out, "w") as f:
      json.dump(results, f, indent=1)
  print(f"\n{'skew':<11}{'active':>8}{'K':>6}{'rows>W':>8}{'ratio':>8}{'floor':>8}"
        f"{'best K':>8}{'floor':>7}{'tiles':>7}{'FLOPs':>7}")
  for p in results["sweep"]:
    f = p["floors"]
    measured = (f"{p['ratio']:>8.3f}{p['floor_ratio']:>8.3f}" if "ratio" in p
                else f"{'-':>8}{'-':>8}")
    print(f"{p['skew']:<11}{p['active']:>8.0f}{p['hot_features']:>6}"
          f"{p['rows_over_width']:>8}{measured}{f['kernels']['hot_features']:>8}"
          f"{f['kernels']['ratio']:>7.3f}{f['blocks']['ratio']:>7.3f}"
          f"{f['entries']['ratio']:>7.3f}")


if __name__ == "__main__":
  _define_flags()
  jax.config.config_with_absl()
  app.run(main)
