"""The device a kernel targets: a Hopper GPU, or the Mosaic GPU interpreter on the CPU.

* ``num_sms()``: SM count of the current device, or of the abstract mesh's device (so the
  persistent kernels also trace on the CPU under interpret mode).
* ``interpret_context(interpret)``: the context in which a kernel built with
  ``plgpu.InterpretGPUParams`` runs on the CPU (an abstract H100-like device with 8 SMs).
* ``arrange_interpreter_threads()``: enough XLA CPU threads for the interpreter (run when the
  package is imported); ``interpret_params``: a kernel's ``interpret=`` argument.
* ``default_device()``: the device a call without committed inputs runs on;
  ``on_hopper(device)``, ``check_triton_warps``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
from jax.extend import backend


# SM count of the abstract device the interpreter runs kernels on (see interpret_context).
_INTERPRET_SMS = contextvars.ContextVar("interpret_sms", default=None)


def num_sms() -> int:
  abstract_device = jax.sharding.get_abstract_mesh().abstract_device
  if abstract_device is not None and abstract_device.num_cores:
    return abstract_device.num_cores
  if (interpret_sms := _INTERPRET_SMS.get()) is not None:
    return interpret_sms
  dev = backend.get_default_device()
  return getattr(dev, "core_count", None) or 132


def default_device():
  """The device JAX runs a computation of uncommitted arrays on: `jax.default_device`'s
  (a device, or a platform name) where set, else the first device; None without a backend."""
  chosen = jax.config.jax_default_device
  try:
    if isinstance(chosen, str):
      return jax.devices(chosen)[0]
    return chosen if chosen is not None else jax.devices()[0]
  except RuntimeError:
    return None


def on_hopper(device=None) -> bool:
  """Whether `device` (default: `default_device()`) is a Hopper GPU."""
  dev = default_device() if device is None else device
  if dev is None or dev.platform != "gpu":
    return False
  kind = dev.device_kind
  if "H100" in kind or "H200" in kind or "H800" in kind or "GH200" in kind:
    return True
  return getattr(dev, "compute_capability", "") in ("9.0", "9.0a")


@contextlib.contextmanager
def interpret_context(interpret: bool, num_cores: int = 8):
  """An abstract GPU device for the SM-count lookups when interpreting on the CPU.

  Inside shard_map the abstract mesh is the (CPU) mesh being mapped over, which must stay
  in place; there `num_cores` reaches `num_sms` through a context variable instead.
  """
  if not interpret:
    yield
    return
  if jax.sharding.get_abstract_mesh().abstract_device is not None:
    token = _INTERPRET_SMS.set(num_cores)
    try:
      yield
    finally:
      _INTERPRET_SMS.reset(token)
    return
  mesh = jax.sharding.AbstractMesh(
      (), (),
      abstract_device=jax.sharding.AbstractDevice(
          device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=num_cores))
  with jax.sharding.use_abstract_mesh(mesh):
    yield


# The Mosaic GPU interpreter runs each warpgroup of a CTA as an XLA CPU computation of its own,
# and a warpgroup waiting at a barrier for another blocks the XLA CPU thread that runs it. XLA
# sizes that thread pool once, when JAX's CPU client starts: from PJRT_NPROC, else NPROC, else
# the cores this process may run on. With fewer threads than a kernel has warpgroups waiting
# on each other (the gate kernel has 3, plus the thread of the computation that launched them)
# the kernel never finishes: any 2-core machine. 3 measured enough, 2 hung; the pool is given
# 8 for a margin, and fewer than 4 is refused.
INTERPRETER_THREADS = 8
MIN_INTERPRETER_THREADS = 4


def _cpu_pool_threads() -> int:
  """The size XLA gives its CPU thread pool in this environment (PJRT_NPROC, NPROC, cores)."""
  for name in ("PJRT_NPROC", "NPROC"):
    value = os.environ.get(name, "")
    if value.strip().isdigit():
      return int(value)
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:   # not Linux
    return os.cpu_count() or 1


def _cpu_client_started() -> bool:
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return xla_bridge.backends_are_initialized()


def arrange_interpreter_threads() -> bool:
  """Gives XLA's CPU thread pool the interpreter's `INTERPRETER_THREADS` when the machine has
  fewer cores, by setting PJRT_NPROC before JAX's CPU client starts (importing
  ``pallas_kernels`` or ``twell_jax`` does this). Nothing changes where PJRT_NPROC or NPROC is
  set, the cores suffice, or the client already runs. Returns whether it set PJRT_NPROC."""
  if _cpu_pool_threads() >= INTERPRETER_THREADS or _cpu_client_started():
    return False
  os.environ["PJRT_NPROC"] = str(INTERPRETER_THREADS)
  return True


def check_interpreter_threads() -> None:
  """RuntimeError, in place of a kernel that would never finish, where JAX's CPU client runs
  with too few threads for the interpreter (`arrange_interpreter_threads`)."""
  threads = _cpu_pool_threads()
  if threads < MIN_INTERPRETER_THREADS and _cpu_client_started():
    raise RuntimeError(
        f"the Mosaic GPU interpreter needs {MIN_INTERPRETER_THREADS} or more XLA CPU threads and "
        f"JAX's CPU client started with {threads} (this machine's cores): its kernels would "
        "wait forever. Import twell_jax (or pallas_kernels) before the first JAX computation, "
        f"or set PJRT_NPROC={INTERPRETER_THREADS} in the environment.")


def interpret_params(interpret, detect_races: bool = False):
  """Maps ``interpret`` (bool or InterpretGPUParams) to the ``interpret=`` kernel argument."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if interpret is False or interpret is None:
    return False
  check_interpreter_threads()
  if interpret is True:
    return plgpu.InterpretGPUParams(detect_races=detect_races)
  return interpret


def check_triton_warps(num_warps: int) -> None:
  """ValueError unless ``num_warps`` is a Triton program's warp count."""
  if num_warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"{num_warps=} must be 1, 2, 4, 8 or 16")
