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
every 20 forward calls; the defaults here come from the kernel benchmarks (the sparse
forward + backward beats dense below about 50 active per token at the paper's shape).
"""

from __future__ import annotations

import dataclasses

import numpy as np

DEFAULT_SPARSE_BELOW = 40.0
DEFAULT_DENSE_ABOVE = 56.0


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

  def describe(self) -> str:
    """'S' for a sparse layer, 'D' for a dense one, in layer order."""
    return "".join("S" if name == self.sparse else "D" for name in self.current)
