"""How fast the Mosaic GPU kernels are against the dense FFN at a given shape (measured).

The kernels' speed-up depends on the shape: below D of about 1000 a 256-column tile and a
D-long weight row are little work per launch, and the kernels' fixed costs (the packing, the
conversion, the row gathers' latency) do not shrink with the GEMMs they replace. `MEASURED`
holds, per FFN shape (D, H) and token count M, the time of `twell_jax.ffn(implementation=
"mosaic_gpu")` over `implementation="dense"`, forward and forward + backward, on an H100 at 30
active features per token spread uniformly (`benchmarks.sweeps.shapes`; the rows of
`benchmarks/results/h100/matrix.json`, which a test keeps equal to this table).

* `kernel_ratio(d, h, m, mode)`: the measured ratio of the nearest measured shape (distance
  in log D, log H, and log M at a quarter of the weight: M moves the ratio least).
* `sparse_loses(d, h, m)`: the kernels are slower than dense there, forward or forward +
  backward: `implementation=None` and the trainer's per-layer choice then run the dense FFN.
* `shape_factor(d, h, m, mode)`: the ratio over the paper shape's (D=2048, H=5632), which
  scales the per-layer cost model fitted at the paper shape (`train.models.layer_choice`).
"""

from __future__ import annotations

import math

__all__ = ["MEASURED", "PAPER", "kernel_ratio", "sparse_loses", "shape_factor"]

# (d, h, m): (forward ratio, forward + backward ratio); H100, uniform, 30 active per token.
MEASURED = {
    (768, 3072, 8192): (1.175, 1.374),
    (768, 2816, 8192): (1.209, 1.386),
    (960, 2560, 8192): (1.459, 1.387),
    (896, 4864, 8192): (0.892, 1.062),
    (896, 4864, 5000): (1.032, 1.043),
    (1536, 8960, 8192): (0.714, 0.640),
    (2048, 5632, 8192): (0.753, 0.749),
}
PAPER = (2048, 5632, 8192)
MODES = ("fwd", "fwd_bwd")


def _nearest(d: int, h: int, m: int | None) -> tuple[int, int, int]:
  def dist(key):
    kd, kh, km = key
    out = math.log(d / kd) ** 2 + math.log(h / kh) ** 2
    if m:
      out += (0.25 * math.log(m / km)) ** 2
    return out
  return min(MEASURED, key=dist)


def kernel_ratio(d: int, h: int, m: int | None = None, mode: str = "fwd_bwd") -> float:
  """The kernels' time over dense's at the measured shape nearest to (d, h, m)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
  if d <= 0 or h <= 0:
    raise ValueError(f"d and h must be positive; got {d=}, {h=}")
  return MEASURED[_nearest(d, h, m)][MODES.index(mode)]


def sparse_loses(d: int, h: int, m: int | None = None) -> bool:
  """Whether the kernels are slower than dense at this shape, forward or forward + backward."""
  return max(kernel_ratio(d, h, m, mode) for mode in MODES) >= 1.0


def shape_factor(d: int, h: int, m: int | None = None, mode: str = "fwd_bwd") -> float:
  """kernel_ratio at (d, h, m) over the paper shape's."""
  return kernel_ratio(d, h, m, mode) / MEASURED[PAPER][MODES.index(mode)]
