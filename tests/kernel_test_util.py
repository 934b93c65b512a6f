"""Helpers shared by the kernel tests (not a test module)."""

from __future__ import annotations

from unittest import mock

import jax
import numpy as np
from absl.testing import parameterized

from pallas_kernels import _target as target
from twell_jax.testing import ffn_inputs


def inputs(m, d, h, *, active=8.0, heavy=0.0, empty=0.0, gated=True, seed=0, **skew):
  """bf16 (x, w_gate, w_up, w_down) from `twell_jax.testing.ffn_inputs` with ~`active` gate
  features per ordinary row; `skew`: its dead_fraction / hottest / row_spread."""
  return ffn_inputs(jax.random.key(seed), m, d, h, active_fraction=min(active / h, 0.5),
                    heavy_fraction=heavy, empty_fraction=empty, gated=gated, **skew)


def lower_for_cuda(f, *args, **kwargs):
  """Lowers ``jax.jit(f)`` for CUDA on any host (returns the Lowered object).

  Pallas builds the whole Mosaic GPU module (and the Triton module of a Triton-backend
  kernel) in Python at this point, so layout / lowering errors show up on the CPU without a
  GPU (only the final compile is left for the device). Triton's lowering asks the device for
  its compute capability: without a GPU it is told an H100's.
  """
  from jax._src.pallas.triton import gpu_info  # pylint: disable=import-outside-toplevel
  from jax._src.pallas.triton import pallas_call_registration  # pylint: disable=import-outside-toplevel
  lowered = lambda: jax.jit(f, **kwargs).trace(*args).lower(lowering_platforms=("cuda",))
  if target.on_hopper():
    return lowered()
  h100 = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  with mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info", h100):
    return lowered()


def rel(a, b) -> float:
  """||a - b|| / ||b|| in float64; fails on non-finite values of a."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite values"
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_race_free(fn):
  """Runs fn(interpret_params) under the interpreter's race detector; fails on a race."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  out = jax.block_until_ready(fn(plgpu.InterpretGPUParams(detect_races=True)))
  assert not gpu_callbacks.get_races().races_found, "the race detector found a race"
  return out


class KernelTestBase(parameterized.TestCase):
  """INTERPRET = True runs the kernels in the Mosaic GPU interpreter (CPU); False needs a
  Hopper GPU and skips elsewhere."""
  INTERPRET = False

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and not target.on_hopper():
      self.skipTest("needs a Hopper GPU")
