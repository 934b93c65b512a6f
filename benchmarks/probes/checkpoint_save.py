r"""What a checkpoint save blocks the training loop for, first save against later ones.

    python -m benchmarks.probes.checkpoint_save --mode=save       # the trainer's own save
    python -m benchmarks.probes.checkpoint_save --mode=pinned     # orbax's copy on a GPU
    python -m benchmarks.probes.checkpoint_save --mode=unpinned   # copy_to_host_async instead
    python -m benchmarks.probes.checkpoint_save --mode=warm       # the pinned pool filled ahead

Whole runs of the paper 0.5B shape lost ~4 s (dense SiLU, H200) to 8.6 s (sparse, a build
beside it) in the 50 steps after their first checkpoint and nothing after the second. Orbax
copies every state array to host memory before `save` returns; on a GPU into pinned host
memory (`jax.device_put` to memory kind "pinned_host"). Each mode runs in a fresh process
(the host allocator's state is per process) on the paper 0.5B train state (f32 parameters and
AdamW moments, ~5.7 GB) and times `--saves` rounds: `save` the seconds
`train.state.checkpointing.save` took to return (its background write waited for before
the next round); `pinned` and `unpinned` the host copy alone. One JSON line per round.
Measured on an H200: the first pinned copy blocks 4.6 s, later ones 0.1 s; unpinned ones
2.8-3.9 s each; the trainer's first save 3.2 s, later ones 0.13 s.

`warm` asks whether the first save's cost can move off the loop: a loop of bf16 GEMMs stands
in for training (`loop_ms`: its mean step alone, then while a thread makes one pinned copy of
the state and drops it), then the trainer's save is timed as in `save` (`blocked_s`).
"""

from __future__ import annotations

import json
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks.common import trained
from train.state import checkpointing
from train.state import trainer as trainer_lib

flags.DEFINE_enum("mode", "save", ["save", "pinned", "unpinned", "warm"], "what is timed")
flags.DEFINE_integer("saves", 3, "rounds")
flags.DEFINE_integer("loop_n", 8192, "--mode=warm: the loop's GEMMs are [N, N] @ [N, N]")


def _state():
  cfg = trained.config_for("paper_0p5b")
  tr = trainer_lib.Trainer(cfg)
  return jax.block_until_ready(tr.new_state(jax.random.key(0)))


def _copy(state, pinned: bool) -> None:
  leaves = jax.tree.leaves(state)
  if pinned:
    out = [jax.device_put(x, jax.sharding.SingleDeviceSharding(
        next(iter(x.devices())), memory_kind="pinned_host")) for x in leaves]
  else:
    for x in leaves:
      x.copy_to_host_async()
    out = leaves
  for x in out:
    np.asarray(x)


def _loop_ms(steps: int, stop=None) -> float:
  """Mean ms of bf16 [N, N] GEMM steps (`--loop_n`), each waited for (until `stop` is set, if
  given)."""
  n = flags.FLAGS.loop_n
  x = jax.numpy.ones((n, n), jax.numpy.bfloat16)
  f = jax.jit(lambda a: (a @ a) * 1e-4)
  jax.block_until_ready(f(x))
  n, t0 = 0, time.perf_counter()
  while n < steps or (stop is not None and not stop.is_set()):
    x = jax.block_until_ready(f(x))
    n += 1
  return (time.perf_counter() - t0) * 1e3 / n


def _warm(state) -> dict:
  import threading  # pylint: disable=import-outside-toplevel
  alone = _loop_ms(50)
  done, took = threading.Event(), {}

  def copy():
    t0 = time.perf_counter()
    _copy(state, pinned=True)
    took["s"] = time.perf_counter() - t0
    done.set()
  threading.Thread(target=copy).start()
  beside = _loop_ms(1, stop=done)
  return {"loop_ms_alone": round(alone, 2), "loop_ms_beside_copy": round(beside, 2),
          "copy_s": round(took["s"], 3)}


def main(argv):
  del argv
  fl = flags.FLAGS
  state = _state()
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  mngr, warm = None, {}
  if fl.mode == "warm":
    warm = _warm(state)
  if fl.mode in ("save", "warm"):
    mngr = checkpointing.make_manager(tempfile.mkdtemp(), every_steps=1, keep=1)
  for i in range(fl.saves):
    # A fresh copy each round, as a training step's new state would be.
    state = jax.block_until_ready(jax.tree.map(lambda x: x + 0 if x.ndim else x, state))
    t0 = time.perf_counter()
    if mngr is not None:
      checkpointing.save(mngr, i + 1, state, {"processes": []}, {"step": i + 1})
    else:
      _copy(state, fl.mode == "pinned")
    blocked = time.perf_counter() - t0
    waited = 0.0
    if mngr is not None:
      t1 = time.perf_counter()
      mngr.wait_until_finished()
      waited = time.perf_counter() - t1
    print(json.dumps({"mode": fl.mode, "round": i + 1, "gb": nbytes / 1e9,
                      "blocked_s": round(blocked, 3), "write_s": round(waited, 3),
                      "device": jax.devices()[0].device_kind, **warm}), flush=True)
  if mngr is not None:
    checkpointing.finish(mngr)


if __name__ == "__main__":
  app.run(main)
