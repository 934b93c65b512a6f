"""Named benchmark shapes and input distributions (one table for every benchmark).

A `Spec` is a feed-forward call: M tokens, D model width, H hidden width, and how the gate's
activity is spread (the arguments of `twell_jax.testing.ffn_inputs`): mean active features per
ordinary row, heavy rows, dead features, the hottest feature's firing rate and the row-length
spread. `paper_*` specs are the paper's shape (D=2048, H=5632) at 16384 tokens (8 x 2048).

The `*_skew` / `*_extreme` specs are calibrated to activations captured from the paper-shape
model trained with L1 (`benchmarks/captured.py` prints captured and generated statistics side
by side): most features never fire in a batch, a few fire on most tokens, rows are
heavy-tailed. Uniform specs (`paper_16k`) are one case among several, not the target.
"""

from __future__ import annotations

import dataclasses

import jax

from twell_jax.testing import ffn_inputs


@dataclasses.dataclass(frozen=True)
class Spec:
  m: int
  d: int = 2048
  h: int = 5632
  active: float = 30.0            # mean active features per ordinary row
  heavy: float = 0.0              # fraction of heavy rows (~half of the alive features active)
  dead_fraction: float = 0.0      # features that never fire
  hottest: float | None = None    # firing rate of the most popular feature (None: uniform)
  row_spread: float = 0.0         # sigma of the per-row log-normal scale
  gated: bool = True
  ell_width: int = 128            # training layout: ELL slots per row
  tail_rows: int | None = None    # training layout: dense-tail rows (None: M/8)

  def inputs(self, seed: int = 0):
    """(x, w_gate or None, w_up, w_down), bf16, deterministic in `seed`."""
    return ffn_inputs(jax.random.key(seed), self.m, self.d, self.h,
                      active_fraction=self.active / self.h, heavy_fraction=self.heavy,
                      dead_fraction=self.dead_fraction, hottest=self.hottest,
                      row_spread=self.row_spread, gated=self.gated)


_PAPER_M = 16384
# Calibrated to captured layers (see the module docstring): paper-like activity (~25-40 active
# per token; a quarter of the features alive in a batch, the hottest on ~60% of the tokens)
# and the extreme level (< 10 per token, ~3% alive).
_SKEW = dict(dead_fraction=0.75, hottest=0.6, row_spread=0.35)
_EXTREME = dict(active=6.0, dead_fraction=0.97, hottest=0.7, row_spread=0.5)

SPECS = {
    "tiny": Spec(128, 128, 256, active=8.0, heavy=0.02, ell_width=16),
    "small": Spec(2048, 1024, 2816),
    "paper_16k": Spec(_PAPER_M),
    "paper_16k_heavy": Spec(_PAPER_M, heavy=0.01),
    "paper_16k_a60": Spec(_PAPER_M, active=60.0),
    "paper_16k_nongated": Spec(_PAPER_M, gated=False),
    "paper_16k_w64": Spec(_PAPER_M, ell_width=64),
    "paper_131k": Spec(131072),
    "paper_16k_skew": Spec(_PAPER_M, **_SKEW),
    "paper_16k_extreme": Spec(_PAPER_M, **_EXTREME),
    "tiny_skew": Spec(256, 128, 512, active=10.0, heavy=0.02, ell_width=16,
                      dead_fraction=0.8, hottest=0.7, row_spread=0.5),
}


def get(name: str) -> Spec:
  if name not in SPECS:
    raise KeyError(f"unknown spec {name!r}; known: {', '.join(SPECS)}")
  return SPECS[name]
