"""Named benchmark shapes and input distributions (one table for every benchmark).

A `Spec` is a feed-forward call: M tokens, D model width, H hidden width, and how the gate's
activity is spread (the arguments of `twell_jax.testing.ffn_inputs`): mean active features per
ordinary row, heavy rows and how full they are, dead features, the hottest feature's firing
rate, the shares of the most popular features and the row-length spread. `paper_*` specs are
the paper's shape (D=2048, H=5632) at 16384 tokens (8 x 2048).

The `paper_16k_skew_l<i>` / `paper_16k_extreme_l<i>` specs reproduce layer i of the paper-shape
model trained with L1 to the paper-like and the extreme activity level (`benchmarks/sweeps/captured.py`
captures it and prints captured and generated statistics side by side): their arguments are
`benchmarks.sweeps.captured.fit_generator` of the captured statistics, and the tests check that the
generated batches land on them. `paper_16k_skew` / `paper_16k_extreme` are the layers in the
middle of their level by activity. Uniform specs (`paper_16k`) are one case among several, not
the target. `paper_16k_block<K>` put all activity on K features with K forced (no tail).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import twell_jax as tj
from twell_jax import features as tj_features
from twell_jax.testing import ffn_inputs

# The L1 coefficient of the benchmarked loss (`loss_fn`), the paper's default.
LAMBDA = 2e-5


@dataclasses.dataclass(frozen=True)
class Spec:
  m: int
  d: int = 2048
  h: int = 5632
  active: float = 30.0            # mean active features per ordinary row
  heavy: float = 0.0              # fraction of heavy rows
  heavy_fill: float = 0.5         # share of the alive features a heavy row fires
  dead_fraction: float = 0.0      # features that never fire
  hottest: float | None = None    # firing rate of the most popular feature (None: uniform)
  top_shares: tuple = ()          # ((fraction of the features, share of the firings), ...)
  row_spread: float = 0.0         # sigma of the per-row log-normal scale
  gated: bool = True
  ell_width: int = 128            # training layout: ELL slots per row
  tail_rows: int | None = None    # training layout: dense-tail rows (None: M/8)
  hot_block: int | None = None    # K hot features forced (features sorted by all firings)

  def generator_args(self) -> dict:
    """The activity arguments of `twell_jax.testing.ffn_inputs`."""
    return dict(active_fraction=self.active / self.h, heavy_fraction=self.heavy,
                heavy_fill=self.heavy_fill, dead_fraction=self.dead_fraction,
                hottest=self.hottest, top_shares=self.top_shares, row_spread=self.row_spread)

  def inputs(self, seed: int = 0):
    """(x, w_gate or None, w_up, w_down), bf16, deterministic in `seed`."""
    return ffn_inputs(jax.random.key(seed), self.m, self.d, self.h, gated=self.gated,
                      **self.generator_args())


_PAPER_M = 16384
# Per layer of the captured model (benchmarks/results/h100/captured.json), fitted by
# benchmarks.sweeps.captured.fit_generator for 16384 tokens: mean active features per ordinary row,
# dead fraction, the hottest feature's rate, the top-1% and top-10% shares, the row spread and
# the fill of the one heavy row per batch (the captured longest row).
_LAYERS = {
    "skew": (  # paper-like level: 15-78 active per token
        # active  dead    hottest top 1%  top 10% spread  fill
        (77.56, 0.0004, 0.9966, 0.4234, 0.9592, 0.341, 0.914),
        (61.26, 0.5993, 0.9998, 0.5713, 0.9957, 1.244, 0.564),
        (17.18, 0.7928, 1.0000, 0.8679, 0.9953, 0.289, 0.720),
        (33.86, 0.8949, 0.9939, 0.7219, 1.0000, 0.314, 0.525),
        (36.24, 0.8168, 0.8456, 0.3684, 0.9595, 0.148, 0.266),
        (48.21, 0.7976, 0.6844, 0.3103, 0.8847, 0.169, 0.143),
        (42.06, 0.8594, 0.9288, 0.4780, 0.9905, 0.182, 0.191),
        (14.89, 0.9474, 0.7992, 0.8341, 1.0000, 0.144, 0.206),
    ),
    "extreme": (  # extreme level: 4-22 active per token
        (21.23, 0.0076, 0.7541, 0.5802, 0.9914, 0.538, 0.991),
        (4.188, 0.6953, 0.4607, 0.8537, 0.9620, 0.461, 0.769),
        (3.754, 0.9442, 0.4654, 0.9724, 1.0000, 0.216, 0.631),
        (5.143, 0.9675, 0.5456, 0.9268, 1.0000, 0.212, 0.377),
        (6.335, 0.9020, 0.1575, 0.5048, 1.0000, 0.131, 0.281),
        (10.91, 0.8127, 0.2893, 0.3370, 0.9045, 0.120, 0.155),
        (16.93, 0.8803, 0.5481, 0.5491, 0.9916, 0.143, 0.141),
        (6.505, 0.9542, 0.4576, 0.8570, 1.0000, 0.134, 0.182),
    ),
}
_MIDDLE_LAYER = {"skew": 4, "extreme": 7}


def _captured_layer(active, dead, hottest, top1, top10, spread, fill) -> Spec:
  return Spec(_PAPER_M, active=active, heavy=1 / _PAPER_M, heavy_fill=fill,
              dead_fraction=dead, hottest=hottest, top_shares=((0.01, top1), (0.1, top10)),
              row_spread=spread)


SPECS = {
    "tiny": Spec(128, 128, 256, active=8.0, heavy=0.02, ell_width=16),
    "small": Spec(2048, 1024, 2816),
    "paper_16k": Spec(_PAPER_M),
    "paper_16k_heavy": Spec(_PAPER_M, heavy=0.01),
    "paper_16k_a60": Spec(_PAPER_M, active=60.0),
    "paper_16k_nongated": Spec(_PAPER_M, gated=False),
    "paper_16k_w64": Spec(_PAPER_M, ell_width=64),
    "paper_131k": Spec(131072),
    **{f"paper_16k_{level}": _captured_layer(*layers[_MIDDLE_LAYER[level]])
       for level, layers in _LAYERS.items()},
    **{f"paper_16k_{level}_l{i}": _captured_layer(*row)
       for level, layers in _LAYERS.items() for i, row in enumerate(layers)},
    # All activity on K features, each on a quarter of the tokens, none outside: what hot
    # features alone cost (the per-layer choice's cost model, train/models/layer_choice.py).
    **{f"paper_16k_block{k}": Spec(_PAPER_M, active=k / 4, dead_fraction=1 - k / 5632,
                                   hot_block=k) for k in (1024, 2048, 3328)},
    "tiny_skew": Spec(256, 128, 512, active=10.0, heavy=0.02, ell_width=16,
                      dead_fraction=0.8, hottest=0.7, row_spread=0.5),
}


def get(name: str) -> Spec:
  if name not in SPECS:
    raise KeyError(f"unknown spec {name!r}; known: {', '.join(SPECS)}")
  return SPECS[name]


def calibrated_inputs(spec: Spec):
  """The spec's inputs with the features sorted by their activity on x, and the number of hot
  features to compute densely (`twell_jax.features.calibrate`): what a model whose features
  are kept sorted runs. Uniform activity gives K = 0; a spec's `hot_block` is taken as K."""
  x, wg, wu, wd = spec.inputs()
  if spec.hot_block is not None:
    gate = jnp.dot(x, wg if spec.gated else wu, preferred_element_type=jnp.float32)
    counts = jnp.sum(gate > 0, axis=0, dtype=jnp.int32)
    wg, wu, wd, _ = tj_features.sort_features(wg, wu, wd, counts)
    return (x, wg, wu, wd), spec.hot_block
  wg, wu, wd, k = tj_features.calibrate(x, wg, wu, wd)
  return (x, wg, wu, wd), k


def loss_fn(impl: str, spec: Spec, interpret: bool = False, hot_features: int = 0):
  """loss(x, wg, wu, wd, ct) = sum(y * ct) + LAMBDA * l1 of `twell_jax.ffn(implementation=impl)`
  (the cotangent ct an argument, not a constant of the program)."""
  def loss(x, wg, wu, wd, ct):
    y, st = tj.ffn(x, wg, wu, wd, implementation=impl, return_stats=True, interpret=interpret,
                   ell_width=spec.ell_width, tail_rows=spec.tail_rows,
                   hot_features=hot_features)
    return jnp.sum(y.astype(jnp.float32) * ct) + LAMBDA * st.l1
  return loss
