r"""Probe: how long a train step takes to build, alone and on a thread beside training.

    python -m benchmarks.probes.background_build [--background=512:untuned,...] [--budget_s=240]
    python -m benchmarks.probes.background_build --batch=32 --foreground_keys=0-256-...

The per-layer FFN choice (`train.choice_steps.StepBuilds`) compiles a new train step on a
worker thread while the current one keeps training. At the paper 0.5B shape
(`benchmarks.common.trained.config_for`, `--batch` rows a step over a data-parallel mesh of every
device) this measures:

* the dense step and a mixed-K sparse step (`--mixed`), each built in the foreground tuned
  (XLA's defaults) and untuned (`train.compilation.NO_AUTOTUNE`): trace, lowering and compile
  times, then step times in alternating chunks (what the untuned build costs);
* per `--background` case `K:options`, a build through `StepBuilds` beside the dense
  step's loop: how long it takes and the loop's step time meanwhile. K is one number of hot
  features for every layer or one per layer joined by `-` (layers with different K compile
  as separate groups; K = 0: that layer dense); options `tuned`, `untuned` or
  `untuned_2threads` (XLA compiling on two threads).
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks.common import trained
from train.state import trainer as trainer_lib
from train.runtime import compilation
from train.training import choice_steps

_BACKGROUND = flags.DEFINE_list(
    "background", ["512-256-256-256-512-512-768-256:untuned",
                   "512-256-256-256-512-512-768-256:tuned"],
    "background builds, K:options (module docstring)")
_MIXED = flags.DEFINE_string("mixed", "768-256-256-256-768-768-512-256",
                             "per-layer hot features of the foreground tuned/untuned pair")
_OPTIONS = {"tuned": None, "untuned": compilation.NO_AUTOTUNE,
            # XLA's compile on two threads, not one per core: does the loop slow down less?
            "untuned_2threads": {**compilation.NO_AUTOTUNE,
                                 "xla_gpu_force_compilation_parallelism": 2}}
_FOREGROUND = flags.DEFINE_bool("foreground", True, "also time the dense and --mixed steps "
                                "built tuned and untuned in the foreground")
_BUDGET = flags.DEFINE_float("budget_s", 240.0, "longest wait for one background build")
_BATCH = flags.DEFINE_integer("batch", None, "rows a step (default: the config's)")
_FOREGROUND_KEYS = flags.DEFINE_list("foreground_keys", [], "per-layer K built untuned in the "
                                     "foreground first, each timed alone")


def _build(tr, key, specs, options=None) -> tuple:
  t0 = time.perf_counter()
  traced = tr.jit_train_step(key).trace(*specs)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile(compiler_options=options)  # as Trainer.compile_train_step
  t3 = time.perf_counter()
  return compiled, {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
                    "total_s": t3 - t0}


def _loop_ms(step, state, batch, n: int):
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  for _ in range(n):
    state, m = step(state, batch)
  jax.block_until_ready(m)
  return state, (time.perf_counter() - t0) * 1e3 / n


def main(argv):
  del argv
  import faulthandler  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  # A build that never ends shows where every thread is.
  faulthandler.dump_traceback_later(_BUDGET.value + 30, repeat=True, file=sys.stderr)
  cfg = trained.config_for("paper_0p5b", batch=_BATCH.value)
  cfg.model.ffn_implementation = None
  tr = trainer_lib.Trainer(cfg)
  n_layers = tr.model_cfg.n_layers
  state = tr.new_state(jax.random.key(0))
  like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
  rows = cfg.batch_size
  tokens = np.random.default_rng(0).integers(
      0, tr.model_cfg.vocab_size, (1, rows, cfg.data.seq_len + 1), dtype=np.int32)
  batch = tr.put_batch(tokens, tr.batch_sharding)
  specs = (jax.tree.map(like, state), like(batch))
  def sparse(k):
    hot = [int(h) for h in str(k).split("-")]
    hot = hot * n_layers if len(hot) == 1 else hot
    return tuple("mosaic_gpu" if h else "dense" for h in hot), tuple(hot)

  def show(label, t):
    print(f"{label}:", {k: round(v, 1) for k, v in t.items()}, flush=True)

  print(f"mesh {dict(tr.mesh.shape)}, {rows} rows a step", flush=True)
  dense_key = (("dense",) * n_layers, (0,) * n_layers)
  built = {}
  for k in _FOREGROUND_KEYS.value:
    show(f"foreground K={k} (untuned) build", _build(tr, sparse(k), specs, _OPTIONS["untuned"])[1])
  foreground = ("tuned", "untuned")
  pairs = (("dense", dense_key), ("mixed", sparse(_MIXED.value)))
  for name, key in pairs if _FOREGROUND.value else pairs[:1]:
    for opt_name in foreground if _FOREGROUND.value else ("tuned",):
      built[name, opt_name], t = _build(tr, key, specs, _OPTIONS[opt_name])
      show(f"foreground {name} ({opt_name}) build", t)
  # Tuned against untuned in alternating chunks (the state trains on: the chunks share it).
  for name in ("dense", "mixed") if _FOREGROUND.value else ():
    times = {o: [] for o in foreground}
    for o in foreground:
      state, _ = _loop_ms(built[name, o], state, batch, 3)
    for _ in range(4):
      for o in foreground:
        state, ms = _loop_ms(built[name, o], state, batch, 10)
        times[o].append(round(ms, 1))
    print(f"{name} step ms per 10, alternating:", times, flush=True)
  state, ms = _loop_ms(built["dense", "tuned"], state, batch, 20)
  print(f"dense step ms alone: {ms:.1f}", flush=True)

  # The trainer's background builds (train.choice_steps.StepBuilds) beside the dense step's
  # loop: the loop's step time while each builds, and how long it takes.
  dense_step = built["dense", "tuned"]
  for case in _BACKGROUND.value:
    k, opt_name = case.split(":")
    steps = choice_steps.StepBuilds(
        lambda key, o=_OPTIONS[opt_name]: _build(tr, key, specs, o))
    t0 = time.perf_counter()
    steps.request(sparse(k))
    loop = []
    while not steps.done(sparse(k)) and time.perf_counter() - t0 < _BUDGET.value:
      state, ms = _loop_ms(dense_step, state, batch, 10)
      loop.append(round(ms, 1))
    label = f"background sparse K={k} ({opt_name})"
    if steps.done(sparse(k)):
      show(f"{label} build", steps.get(sparse(k))[1])
    else:
      print(f"{label} build: not done after {time.perf_counter() - t0:.0f} s", flush=True)
    print("  dense step ms per 10 steps meanwhile:", loop, flush=True)
    steps.close()


if __name__ == "__main__":
  app.run(main)
