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
  shape) while the current one keeps running, and `ready` hands over the newest requested
  step that is built (a request that arrives while another builds replaces the queued one;
  the one in flight is still handed over when done, being closer to the latest choice than
  the step running). Executables are kept, so switching back costs nothing.
  `background=False` builds in `request` (the switch lands on the decision step:
  reproducible).

  Lowering a Pallas kernel is Python work that holds the GIL; while a build runs the
  interpreter's switch interval is shortened, so that the training loop's dispatch is not
  kept waiting behind it (the device would idle).
  """

  _BUILD_SWITCH_INTERVAL_S = 2e-4

  def __init__(self, build, background: bool = True):
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel
    self._build = build
    self._background = background
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._lock = threading.Lock()
    self._done: dict[tuple, object] = {}
    self._seq = 0                    # requests so far
    self._newest_built = (0, None)   # (request number, names) of the newest built request
    self._handed = 0                 # request number handed over last
    self._queued = []
    self.last_build_s = None         # seconds the last background build took

  def get_now(self, names: tuple):
    """The step for `names`, compiled in this thread if it is not built yet."""
    if names not in self._done:
      self._done[names] = self._build(names)
    return self._done[names]

  def _built(self, seq: int, names: tuple, step) -> None:
    with self._lock:
      self._done[names] = step
      if seq > self._newest_built[0]:
        self._newest_built = (seq, names)

  def _build_in_background(self, seq: int, names: tuple) -> None:
    import sys  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    interval, t0 = sys.getswitchinterval(), time.perf_counter()
    sys.setswitchinterval(min(interval, self._BUILD_SWITCH_INTERVAL_S))
    try:
      self._built(seq, names, self._build(names))
      self.last_build_s = time.perf_counter() - t0
    finally:
      sys.setswitchinterval(interval)

  def request(self, names: tuple) -> None:
    """Asks for the step of `names` (built in the background unless built before)."""
    self._seq += 1
    if names in self._done:
      self._built(self._seq, names, self._done[names])
    elif self._background:
      for future in self._queued:
        future.cancel()                # not started yet: superseded
      self._queued = [self._pool.submit(self._build_in_background, self._seq, names)]
    else:
      self._built(self._seq, names, self._build(names))

  def ready(self):
    """(names, step) of the newest built request not handed over yet, else None."""
    with self._lock:
      seq, names = self._newest_built
      if seq <= self._handed:
        return None
      self._handed = seq
      return names, self._done[names]

  def close(self):
    for future in self._queued:
      future.cancel()
    self._pool.shutdown(wait=True)
