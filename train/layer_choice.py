"""Per-layer choice of the FFN implementation while sparsity emerges.

From random initialisation a ReLU layer fires on about half of its features, where the
sparse kernels are slower than dense; L1 training brings it down over the first steps, at
different speeds per layer. `LayerChoice` keeps each layer on the dense FFN until its
measured activity (active features per token, `FFNStats.nnz_per_token`) falls below
`sparse_below`, and sends it back only above `dense_above` (hysteresis: no flapping around
one threshold). The decision is made on the host from the step metrics the trainer already
fetches, every `every` steps, and changes the model's static per-layer implementations, so
the step is recompiled only when a layer switches (a few times per run), and no conditional
runs on the device. The reference implementation switches at 50 active features per token
every 20 forward calls.

The thresholds come from the captured-activation benchmark (`benchmarks.captured`, H100,
paper shape, per layer, over dense): the training kernels (forward + backward) win at every
captured layer, up to 85 active per token (0.64), so training switches to sparse below 90; the
inference forward has no hot-column GEMMs and wins only below about 48 active per token
(0.87-0.96 at 40-47, 1.24 at 85), so `for_inference` uses the lower threshold.
"""

from __future__ import annotations

import dataclasses

import numpy as np

DEFAULT_SPARSE_BELOW = 90.0
DEFAULT_DENSE_ABOVE = 110.0
INFERENCE_SPARSE_BELOW = 48.0


@dataclasses.dataclass
class LayerChoice:
  """Per-layer FFN implementation with hysteresis (see the module docstring)."""
  n_layers: int
  sparse: str = "mosaic_gpu"
  dense: str = "dense"
  sparse_below: float = DEFAULT_SPARSE_BELOW
  dense_above: float = DEFAULT_DENSE_ABOVE
  current: list[str] | None = None

  def __post_init__(self):
    if not 0 <= self.sparse_below <= self.dense_above:
      raise ValueError(f"need 0 <= sparse_below ({self.sparse_below}) <= dense_above "
                       f"({self.dense_above})")
    if self.current is None:
      self.current = [self.dense] * self.n_layers

  @classmethod
  def for_inference(cls, active_per_token, sparse: str = "mosaic_gpu") -> "LayerChoice":
    """The per-layer choice for a forward-only model with fixed weights: sparse below
    `INFERENCE_SPARSE_BELOW` active features per token (one decision, no hysteresis)."""
    active = np.asarray(active_per_token, np.float64).reshape(-1)
    choice = cls(active.shape[0], sparse=sparse, sparse_below=INFERENCE_SPARSE_BELOW,
                 dense_above=INFERENCE_SPARSE_BELOW)
    choice.update(active)
    return choice

  def update(self, active_per_token) -> bool:
    """Applies one decision from the layers' active features per token; True if any changed."""
    active = np.asarray(active_per_token, np.float64).reshape(-1)
    if active.shape[0] != self.n_layers:
      raise ValueError(f"got {active.shape[0]} layers' activity for {self.n_layers} layers")
    new = list(self.current)
    for l, a in enumerate(active):
      if new[l] == self.dense and a < self.sparse_below:
        new[l] = self.sparse
      elif new[l] == self.sparse and a > self.dense_above:
        new[l] = self.dense
    changed = new != self.current
    self.current = new
    return changed

  @property
  def implementations(self) -> tuple[str, ...]:
    return tuple(self.current)

  def describe(self, names=None) -> str:
    """'S' for a sparse layer, 'D' for a dense one, in layer order (of `names`, default the
    current choice)."""
    return "".join("S" if name == self.sparse else "D" for name in (names or self.current))


class BackgroundSteps:
  """Compiled train steps per tuple of layer implementations, compiled on a worker thread.

  A switch must not stall training: the new step compiles (tens of seconds at the paper's
  shape) while the current one keeps running, and `ready` hands it over once it is built.
  `build(names)` returns the compiled step for `names`; executables are kept, so switching
  back costs nothing. `background=False` builds in `request` (the switch lands on the
  decision step: reproducible).
  """

  def __init__(self, build, background: bool = True):
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    self._build = build
    self._background = background
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._done: dict[tuple, object] = {}
    self._pending: tuple | None = None
    self._future = None

  def get_now(self, names: tuple):
    """The step for `names`, compiled in this thread if it is not built yet."""
    if names not in self._done:
      self._done[names] = self._build(names)
    return self._done[names]

  def request(self, names: tuple) -> None:
    """Starts building the step for `names` (replaces an earlier request not yet handed over)."""
    self._pending = names
    if names in self._done:
      return
    if self._background:
      self._future = self._pool.submit(self._build, names)
    else:
      self._done[names] = self._build(names)

  def ready(self):
    """(names, step) of the requested step once it is built, else None."""
    if self._pending is None:
      return None
    names = self._pending
    if names not in self._done:
      if not self._future.done():
        return None
      self._done[names] = self._future.result()
    self._pending = None
    return names, self._done[names]

  def close(self):
    self._pool.shutdown(wait=True)
