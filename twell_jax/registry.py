"""The implementations of `twell_jax.ffn`, what each supports, and the automatic choice.

Each implementation answers `unsupported(call)` (None when it can run the call, else the
reason) and runs a validated call on 2-D operands, returning (y, FFNStats).
`implementation=None` takes the first entry of `AUTO_ORDER` that supports the call and is not
measured slower than dense at its shape (`slower(call)`): "mosaic_gpu" (the kernels; Hopper
with bf16, or the interpreter; on a GPU only at shapes where `twell_jax.shape_costs` measured
them faster than dense, forward and forward + backward) and else "dense". "xla",
the sparse algorithm in plain JAX, computes the same function but is slower than dense
everywhere it was measured (docs/performance.md), so it runs only when named; so does "decode", the few-row FFN of decoding (kernels that want
W_up transposed, which a call through `ffn` does each time).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels import _target as target
from twell_jax import dense as dense_lib
from twell_jax import shape_costs
from twell_jax import sparse_xla
from twell_jax import stats as stats_lib

__all__ = ["Call", "IMPLEMENTATIONS", "AUTO_ORDER", "SPARSE", "get", "pick"]


@dataclasses.dataclass(frozen=True)
class Call:
  """The static facts of one `ffn` call (x flattened to [m, d]) that the choice depends on."""
  m: int
  d: int
  h: int
  gated: bool
  dtype: jnp.dtype
  activation: str
  interpret: bool
  ell_width: int
  tail_rows: Optional[int]
  hot_features: int = 0
  # The device the call runs on; None: `pallas_kernels._target.default_device()`, where JAX
  # runs a call whose inputs are not committed to a device.
  device: Optional[jax.Device] = None


class Dense:
  """Plain XLA dense FFN: the baseline; every activation, dtype and backend."""
  name = "dense"
  sparse = False

  def unsupported(self, call: Call) -> Optional[str]:
    del call
    return None

  def slower(self, call: Call) -> bool:
    del call
    return False

  def run(self, call: Call, x, w_gate, w_up, w_down):
    return dense_lib.dense_ffn(x, w_gate, w_up, w_down, call.activation, call.ell_width)


class Xla:
  """The sparse algorithm in plain JAX with a sparse custom VJP (any backend; ReLU gates);
  slower than dense wherever it was measured: chosen only when named."""
  name = "xla"
  sparse = True

  def unsupported(self, call: Call) -> Optional[str]:
    if call.activation != "relu":
      return f"activation={call.activation!r} has no exact zeros to skip"
    return None

  def slower(self, call: Call) -> bool:
    del call
    return True

  def run(self, call: Call, x, w_gate, w_up, w_down):
    return sparse_xla.sparse_ffn(x, w_gate, w_up, w_down, ell_width=call.ell_width,
                                 tail_rows=call.tail_rows)


class MosaicGpu:
  """The Pallas Mosaic GPU kernels (Hopper; the Mosaic GPU interpreter with interpret=True)."""
  name = "mosaic_gpu"
  sparse = True

  def unsupported(self, call: Call) -> Optional[str]:
    reason = _kernels_unsupported(call)
    if reason is not None:
      return reason
    if call.interpret and _manual_devices() > 1:
      # The interpreter keeps one simulated GPU memory per process; kernels of several
      # devices running at once corrupt each other's barrier state.
      return (f"the Mosaic GPU interpreter cannot run inside shard_map over "
              f"{_manual_devices()} devices; use a one-device mesh, implementation='xla' or "
              "'dense', or a GPU")
    from pallas_kernels import ffn_mgpu  # pylint: disable=import-outside-toplevel
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, call.dtype)
    return ffn_mgpu.supports(sds(call.m, call.d), sds(call.d, call.h) if call.gated else None,
                             sds(call.d, call.h), sds(call.h, call.d), interpret=call.interpret,
                             device=call.device)

  def slower(self, call: Call) -> bool:
    """Slower than dense at this shape on a GPU (`shape_costs.sparse_loses`); never in the
    interpreter, which runs for correctness, not speed."""
    return not call.interpret and shape_costs.sparse_loses(call.d, call.h, call.m)

  def run(self, call: Call, x, w_gate, w_up, w_down):
    # Imported on first use: the kernels' modules pull in Mosaic GPU (about 0.7 s).
    from twell_jax import mosaic  # pylint: disable=import-outside-toplevel
    return mosaic.mosaic_ffn(x, w_gate, w_up, w_down, interpret=call.interpret,
                             ell_width=call.ell_width, tail_rows=call.tail_rows,
                             hot_features=call.hot_features)


class Decode:
  """The exact ReLU FFN for few rows (decoding): W_gate, then only the W_up and W_down rows
  of the features that fire in some row (`twell_jax.decode`, Pallas Triton kernels). Through
  `ffn` it transposes W_gate and W_up in every call, so it runs only when named; decode loops
  hold the kernels' layout (`twell_jax.decode.DecodeWeights`)."""
  name = "decode"
  sparse = True

  def unsupported(self, call: Call) -> Optional[str]:
    reason = _kernels_unsupported(call)
    if reason is not None:
      return reason
    from pallas_kernels import decode_ffn_triton  # pylint: disable=import-outside-toplevel
    return decode_ffn_triton.supports(call.m, call.d, call.h, call.dtype)

  def slower(self, call: Call) -> bool:
    del call
    return True

  def run(self, call: Call, x, w_gate, w_up, w_down):
    from twell_jax import decode  # pylint: disable=import-outside-toplevel
    return decode.decode_ffn(x, w_gate, w_up, w_down, interpret=call.interpret,
                             ell_width=call.ell_width)


def _kernels_unsupported(call: Call) -> Optional[str]:
  """Why the Pallas kernels cannot run `call` here (a gate without exact zeros, no GPU and
  no interpreter), or None."""
  if call.activation != "relu":
    return f"activation={call.activation!r} has no exact zeros to skip"
  device = target.default_device() if call.device is None else call.device
  platform = getattr(device, "platform", None)
  if not call.interpret and platform != "gpu":
    return (f"no GPU backend (the call runs on {device}); pass interpret=True to run the "
            "kernels in the interpreter")
  return None


def _manual_devices() -> int:
  """Devices of the shard_map being traced (1 outside shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[name] for name in mesh.manual_axes)


IMPLEMENTATIONS = {impl.name: impl for impl in (Dense(), Xla(), MosaicGpu(), Decode())}
AUTO_ORDER = ("mosaic_gpu", "dense")
SPARSE = tuple(name for name, impl in IMPLEMENTATIONS.items() if impl.sparse)


def get(name: str):
  """The implementation called `name` (ValueError for an unknown name)."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {tuple(IMPLEMENTATIONS)} or None; "
                     f"got {name!r}.")
  return IMPLEMENTATIONS[name]


def pick(call: Call):
  """The first implementation of AUTO_ORDER that supports `call` and is not slower than dense
  at its shape."""
  for name in AUTO_ORDER:
    impl = IMPLEMENTATIONS[name]
    if impl.unsupported(call) is None and not impl.slower(call):
      return impl
  raise AssertionError("the dense implementation supports every call")


def empty_result(call: Call, dtype):
  """(y, stats) of a call with no tokens."""
  return jnp.zeros((0, call.d), dtype), stats_lib.empty_stats(call.h)
