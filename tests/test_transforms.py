"""Every `twell_jax.ffn` implementation under JAX's transforms.

jit, grad, vmap (over x alone and over x and weights, examples taking different
paths), lax.scan over stacked layers with remat, shard_map over tokens, and
forward-mode autodiff, which the sparse implementations refuse with an error
naming the alternative. "mosaic_gpu" and "decode" run their kernels in the interpreter
here (interpret=True on the CPU; on a Hopper GPU the same calls compile them).
Shapes are the smallest the kernels pad to (128 rows, D=128, H=256), so every
case compiles its kernels once.
"""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _target as target
import twell_jax as tj
from twell_jax.testing import ffn_inputs

F32 = jnp.float32
TOL = {"y": 1.5e-2, "grad": 2.5e-2}   # bf16 operands, f32 accumulation (as tests/test_ffn.py)
IMPLEMENTATIONS = ("dense", "xla", "mosaic_gpu", "decode")
D, H, ELL_WIDTH, TAIL_ROWS = 128, 256, 16, 2
INTERPRET = not target.on_hopper()   # the kernels compiled on a Hopper GPU, else interpreted


def _options(impl):
  return dict(implementation=impl, interpret=impl in ("mosaic_gpu", "decode") and INTERPRET,
              ell_width=ELL_WIDTH, tail_rows=TAIL_ROWS)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite values"
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@functools.cache
def _two_examples():
  """x [2, 64, D] and weights: example 0 holds the 64 lightest rows (no row over ELL_WIDTH),
  example 1 the heaviest (more heavy rows than TAIL_ROWS: its dense path)."""
  x, wg, wu, wd = ffn_inputs(jax.random.key(0), 128, D, H, active_fraction=0.02,
                             heavy_fraction=0.08)
  active = np.sum(np.asarray(jnp.dot(x.astype(F32), wg.astype(F32)) > 0), axis=1)
  order = np.argsort(active, kind="stable")
  assert active[order[63]] <= ELL_WIDTH and np.sum(active[order[64:]] > ELL_WIDTH) > TAIL_ROWS
  return x[order].reshape(2, 64, D), wg, wu, wd


def _loss(ffn, ct, x, wg, wu, wd):
  y, l1 = ffn(x, wg, wu, wd)
  return jnp.sum(y.astype(F32) * ct) + 0.5 * l1


def _ours(impl):
  def ffn(x, wg, wu, wd):
    y, st = tj.ffn(x, wg, wu, wd, return_stats=True, **_options(impl))
    return y, st.l1
  return ffn


def _reference(x, wg, wu, wd):
  f32 = lambda a: a.astype(F32)
  return tj.reference_ffn(f32(x), f32(wg), f32(wu), f32(wd))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_vmap_of_value_and_grad_per_example(impl):
  """vmap over x and w_gate (w_up, w_down shared): per-example values, stats and gradients."""
  xb, wg, wu, wd = _two_examples()
  wgb = jnp.stack([wg, wg])
  ct = jax.random.normal(jax.random.key(1), xb.shape[1:], F32)

  def per_example(x, wg, wu, wd):
    y, st = tj.ffn(x, wg, wu, wd, return_stats=True, **_options(impl))
    loss = jnp.sum(y.astype(F32) * ct) + 0.5 * st.l1
    return loss, (y, st)

  grad_fn = jax.value_and_grad(per_example, argnums=(0, 1, 2), has_aux=True)
  (loss, (y, st)), grads = jax.jit(jax.vmap(grad_fn, in_axes=(0, 0, None, None)))(
      xb, wgb, wu, wd)
  assert y.shape == xb.shape and st.l1.shape == (2,) and st.fired.shape == (2, H)
  assert grads[2].shape == (2, D, H)     # per-example gradient of the shared w_up
  ref_grad = jax.grad(functools.partial(_loss, _reference, ct), argnums=(0, 1, 2))
  for i in range(2):
    y_ref, l1_ref = _reference(xb[i], wg, wu, wd)
    assert _rel(y[i], y_ref) < TOL["y"]
    assert _rel(st.l1[i], l1_ref) < TOL["y"]
    for g, r in zip(grads, ref_grad(xb[i].astype(F32), wg.astype(F32), wu.astype(F32),
                                    wd.astype(F32))):
      assert _rel(g[i], r) < TOL["grad"]
  if impl in ("xla", "mosaic_gpu"):   # example 0 stays sparse, example 1 overflows its tail
    assert int(st.overflow_rows[0]) == 0 and int(st.overflow_rows[1]) > TAIL_ROWS


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_vmap_forward_matches_unbatched_calls(impl):
  """Without differentiation (the inference path): vmap equals one call per example."""
  xb, wg, wu, wd = _two_examples()
  f = functools.partial(tj.ffn, return_stats=True, **_options(impl))
  y, st = jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))(xb, wg, wu, wd)
  for i in range(2):
    y_i, st_i = f(xb[i], wg, wu, wd)
    np.testing.assert_array_equal(np.asarray(y[i], F32), np.asarray(y_i, F32))
    np.testing.assert_array_equal(np.asarray(st.fired[i]), np.asarray(st_i.fired))
    assert int(st.overflow_rows[i]) == int(st_i.overflow_rows)


def _scan_model(layer_fn, remat, x, wg, wu, wd):
  """A residual stack of layers: lax.scan over stacked weights [L, ...]."""
  def body(carry, w):
    fn = jax.checkpoint(layer_fn) if remat else layer_fn
    y, l1 = fn(carry.astype(w[0].dtype), *w)
    return carry + y.astype(F32), l1
  out, l1s = jax.lax.scan(body, x.astype(F32), (wg, wu, wd))
  return jnp.sum(out ** 2) / out.size + 0.5 * jnp.mean(l1s)


def _two_layers():
  xb, wg, wu, wd = _two_examples()
  other = ffn_inputs(jax.random.key(2), 64, D, H, active_fraction=0.03)[1:]
  return xb[0], [jnp.stack([w, o]) for w, o in zip((wg, wu, wd), other)]


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_remat"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_scan_over_layers(impl, remat):
  """lax.scan over 2 layers' stacked weights (each layer under jax.checkpoint with remat);
  jit(grad) of x and the weights against the f32 reference."""
  if remat and impl == "mosaic_gpu" and INTERPRET:
    pytest.skip("the interpreter refuses remat under differentiation (next test)")
  x, stacked = _two_layers()
  grads = jax.jit(jax.grad(functools.partial(_scan_model, _ours(impl), remat),
                           argnums=(0, 1, 2, 3)))(x, *stacked)
  ref = jax.grad(functools.partial(_scan_model, _reference, remat), argnums=(0, 1, 2, 3))(
      x.astype(F32), *(w.astype(F32) for w in stacked))
  for g, r in zip(grads, ref):
    assert g.shape == r.shape and _rel(g, r) < 2 * TOL["grad"]   # two layers of bf16 rounding


@pytest.mark.skipif(not INTERPRET, reason="compiled kernels have no effects: remat works")
def test_interpreter_under_remat_and_grad_is_refused_by_jax():
  """The Mosaic GPU interpreter runs kernels through ordered IO callbacks, and JAX refuses
  effects inside jax.checkpoint under differentiation (forward-only remat runs). On a GPU
  the compiled kernels have no effects; on the CPU, implementation="xla" supports it."""
  x, stacked = _two_layers()
  with pytest.raises(NotImplementedError, match="Effects not supported in AD of `checkpoint`"):
    jax.grad(functools.partial(_scan_model, _ours("mosaic_gpu"), True), argnums=1)(x, *stacked)


@pytest.mark.parametrize("impl", ("xla", "mosaic_gpu"))
def test_forward_mode_is_refused_naming_the_alternative(impl):
  xb, wg, wu, wd = _two_examples()
  f = lambda x: tj.ffn(x, wg, wu, wd, **_options(impl))
  with pytest.raises(NotImplementedError, match=r"reverse mode only.*implementation='dense'"):
    jax.jvp(f, (xb[0],), (xb[0],))
  y, tangent = jax.jvp(lambda x: tj.ffn(x, wg, wu, wd, implementation="dense"),
                       (xb[0],), (xb[0],))
  assert tangent.shape == y.shape


def _shard_map_value_and_grads(impl, mesh, x, wg, wu, wd, ct, check_vma=True):
  """Data parallel over `mesh`: each device runs the FFN on its tokens. Returns the loss and
  its gradients, and the same from the f32 reference on the same token shards."""
  from jax.sharding import PartitionSpec as P   # pylint: disable=g-import-not-at-top
  n = mesh.size

  def local(x, wg, wu, wd):
    y, st = tj.ffn(x, wg, wu, wd, return_stats=True, **_options(impl))
    return y, st.l1[None]

  def reference(x, wg, wu, wd):
    shards = [_reference(s, wg, wu, wd) for s in jnp.split(x, n)]
    return jnp.concatenate([y for y, _ in shards]), jnp.stack([l1 for _, l1 in shards])

  def loss(ffn, x, wg, wu, wd):
    y, l1 = ffn(x, wg, wu, wd)
    return jnp.sum(y.astype(F32) * ct) + 0.5 * jnp.mean(l1)

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P(), P()),
                          out_specs=(P("data"), P("data")), check_vma=check_vma)
  ours = jax.jit(jax.value_and_grad(functools.partial(loss, sharded), argnums=(0, 1, 2, 3)))
  ref = jax.value_and_grad(functools.partial(loss, reference), argnums=(0, 1, 2, 3))
  return ours(x, wg, wu, wd), ref(x, wg, wu, wd)


def _assert_close(ours, ref):
  (value, grads), (ref_value, ref_grads) = ours, ref
  assert _rel(value, ref_value) < TOL["y"]
  for g, r in zip(grads, ref_grads):
    assert g.shape == r.shape and _rel(g, r) < TOL["grad"]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_shard_map_value_and_grad(impl):
  """Under shard_map (one CPU device here: the manual-axis typing of every conditional and
  custom VJP is what is checked; the next test runs two devices)."""
  xb, wg, wu, wd = _two_examples()
  # The decode kernels run at most 64 rows (one example); the others take both.
  x = xb[1] if impl == "decode" else xb.reshape(-1, D)
  ct = jax.random.normal(jax.random.key(3), x.shape, F32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  # The Pallas interpreter's loops inside the decode kernels lose the manual-axis typing
  # under check_vma=True (JAX asks for check_vma=False there); twell_jax.sharded, the
  # library's own shard_map, runs with check_vma=False.
  _assert_close(*_shard_map_value_and_grads(impl, mesh, x, wg, wu, wd, ct,
                                            check_vma=impl != "decode"))


_TWO_DEVICE_SCRIPT = textwrap.dedent("""
  import jax, jax.numpy as jnp, numpy as np, pytest
  import test_transforms as tt
  assert len(jax.devices()) == 2
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  xb, wg, wu, wd = tt._two_examples()
  x = xb.reshape(-1, tt.D)
  ct = jax.random.normal(jax.random.key(3), x.shape, tt.F32)
  for impl in ("dense", "xla"):
    tt._assert_close(*tt._shard_map_value_and_grads(impl, mesh, x, wg, wu, wd, ct))
  # The interpreter simulates one GPU per process: refused, naming what works.
  with pytest.raises(NotImplementedError, match="one-device mesh, implementation='xla'"):
    tt._shard_map_value_and_grads("mosaic_gpu", mesh, x, wg, wu, wd, ct)
  print("ok")
""")


def test_shard_map_over_two_devices():
  """Two CPU devices, tokens split between them: the weight gradients are summed over the
  devices by JAX's transpose of the shard_map, outside the custom VJPs."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                         os.environ.get("PYTHONPATH", "")]),
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=2")
  out = subprocess.run([sys.executable, "-c", _TWO_DEVICE_SCRIPT], capture_output=True,
                       text=True, env=env, timeout=600, check=False)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
