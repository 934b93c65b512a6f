"""twell_jax.ffn: forward and gradients of every CPU implementation against the f32 reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from twell_jax.testing import ffn_inputs

F32 = jnp.float32
# bf16 operands with f32 accumulation: relative L2 error of outputs and gradients.
TOL = {"y": 1.5e-2, "grad": 2.5e-2}
L1_COEFF = 0.7   # large enough that the L1 gradient is visible next to dy


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite values"
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _losses(impl, ct, **kw):
  def loss(x, wg, wu, wd):
    y, st = tj.ffn(x, wg, wu, wd, implementation=impl, return_stats=True, **kw)
    return jnp.sum(y.astype(F32) * ct) + L1_COEFF * st.l1

  def ref_loss(x, wg, wu, wd):
    y, l1 = tj.reference_ffn(x, wg, wu, wd)
    return jnp.sum(y * ct) + L1_COEFF * l1
  return loss, ref_loss


def _check(impl, x, wg, wu, wd, grads_of=None, **kw):
  """Forward, stats and all gradients of `impl` against the f32 reference; with `grads_of`,
  the gradients against that implementation's instead (for an `impl` whose gradient is that
  one's by construction: the same bf16 roundings, so a tolerance far below bf16's error)."""
  argnums = (0, 2, 3) if wg is None else (0, 1, 2, 3)
  y, st = jax.jit(functools.partial(tj.ffn, implementation=impl, return_stats=True, **kw))(x, wg, wu, wd)
  y_ref, l1_ref = tj.reference_ffn(x, wg, wu, wd)
  assert y.shape == x.shape and y.dtype == x.dtype
  assert _rel(y, y_ref) < TOL["y"]
  assert _rel(st.l1, l1_ref) < TOL["y"]
  ct = jax.random.normal(jax.random.key(7), x.shape, F32)
  loss, ref_loss = _losses(impl, ct, **kw)
  grads = jax.jit(jax.grad(loss, argnums=argnums))(x, wg, wu, wd)
  f32 = lambda a: None if a is None else a.astype(F32)
  if grads_of is None:
    ref_grads = jax.grad(ref_loss, argnums=argnums)(f32(x), f32(wg), f32(wu), f32(wd))
    tol = TOL["grad"]
  else:
    ref_grads = jax.jit(jax.grad(_losses(grads_of, ct)[0], argnums=argnums))(x, wg, wu, wd)
    tol = 1e-3
  for i, g, r in zip(argnums, grads, ref_grads):
    assert g.dtype == (x, wg, wu, wd)[i].dtype
    assert _rel(g, r) < tol, f"gradient of argument {i}: {_rel(g, r)}"
  return st


def _active_mask(x, wg, wu):
  g = jnp.dot(x.astype(F32), (wu if wg is None else wg).astype(F32))
  return np.asarray(g > 0)


SPARSITY_CASES = {
    # name: (m, d, h, dict of ffn_inputs kwargs, ffn kwargs)
    "0.5pct_active": (130, 48, 320, dict(active_fraction=0.005), {}),
    "5pct_active": (96, 64, 512, dict(active_fraction=0.05), {}),
    "1pct_heavy_rows_in_tail": (200, 40, 512, dict(active_fraction=0.005, heavy_fraction=0.01), dict(ell_width=32)),
    "heavy_rows_over_tail_capacity": (64, 40, 256, dict(active_fraction=0.01, heavy_fraction=0.1), dict(ell_width=16, tail_rows=2)),
    "all_zero_rows": (33, 48, 320, dict(active_fraction=0.02, empty_fraction=0.3), {}),
    "everything_active": (17, 32, 256, dict(active_fraction=0.999), dict(ell_width=64, tail_rows=4)),
}


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", sorted(SPARSITY_CASES))
def test_xla_matches_reference(case, gated):
  m, d, h, gen, kw = SPARSITY_CASES[case]
  seed = sorted(SPARSITY_CASES).index(case)   # fixed: str hashes change between processes
  x, wg, wu, wd = ffn_inputs(jax.random.key(seed), m, d, h, gated=gated, **gen)
  st = _check("xla", x, wg, wu, wd, **kw)
  active = _active_mask(x, wg, wu)
  np.testing.assert_allclose(float(st.nnz_per_token), active.sum(1).mean(), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(st.fired), active.any(0))
  tiles = np.pad(active, ((0, 0), (0, -h % 256))).reshape(m, -1, 256).sum(-1)
  assert int(st.max_tile_nnz) == tiles.max()
  width = min(kw.get("ell_width", 128), h)
  assert int(st.overflow_rows) == int((active.sum(1) > width).sum())


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_dense_matches_reference(activation):
  x, wg, wu, wd = ffn_inputs(jax.random.key(3), 40, 48, 320, active_fraction=0.2)
  y = tj.ffn(x, wg, wu, wd, activation=activation, implementation="dense")
  y_ref, _ = tj.reference_ffn(x, wg, wu, wd, activation=activation)
  assert _rel(y, y_ref) < TOL["y"]
  if activation == "relu":
    _check("dense", x, wg, wu, wd)


def test_leading_axes_and_default_implementation():
  x, wg, wu, wd = ffn_inputs(jax.random.key(4), 24, 32, 256, active_fraction=0.05)
  x3 = x.reshape(2, 3, 4, 32)
  y3 = tj.ffn(x3, wg, wu, wd)            # implementation=None: dense on the CPU (the fastest here)
  assert y3.shape == (2, 3, 4, 32)
  np.testing.assert_array_equal(np.asarray(y3.reshape(24, 32)), np.asarray(tj.ffn(x, wg, wu, wd, implementation="dense")))
  y_xla = tj.ffn(x3, wg, wu, wd, implementation="xla")
  assert y_xla.shape == (2, 3, 4, 32) and _rel(y_xla, y3.astype(F32)) < TOL["y"]
  assert tj.ffn(jnp.zeros((0, 32), jnp.bfloat16), wg, wu, wd).shape == (0, 32)


def test_l1_only_gradient_is_sparse_sign():
  """d(l1)/dW_down is zero and d(l1)/dW_gate only touches active columns."""
  x, wg, wu, wd = ffn_inputs(jax.random.key(8), 64, 32, 256, active_fraction=0.01)
  g = jax.grad(lambda a, b, c: tj.ffn(x, a, b, c, implementation="xla", return_stats=True)[1].l1,
               argnums=(0, 2))(wg, wu, wd)
  assert float(jnp.abs(g[1].astype(F32)).max()) == 0.0
  fired = np.asarray(_active_mask(x, wg, wu).any(0))
  assert np.all(np.asarray(g[0].astype(F32))[:, ~fired] == 0)


def test_mosaic_gpu_without_gpu_is_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  x, wg, wu, wd = ffn_inputs(jax.random.key(9), 8, 64, 256)
  with pytest.raises(NotImplementedError, match="mosaic_gpu"):
    tj.ffn(x, wg, wu, wd, implementation="mosaic_gpu")


def _w(*shape, dtype=jnp.bfloat16):
  return jnp.zeros(shape, dtype)


@pytest.mark.parametrize("args,kwargs,match", [
    ((_w(4, 8), _w(8, 16), _w(8, 16), _w(16, 8)), dict(implementation="cuda"), "implementation must be one of"),
    ((_w(4, 8), _w(8, 16), _w(8, 16), _w(16, 8)), dict(activation="tanh"), "activation must be one of"),
    ((_w(4, 8), _w(8, 16), _w(8, 16), _w(16, 8)), dict(activation="silu", implementation="xla"), "sparse"),
    ((_w(4, 8), _w(8, 16), _w(8, 16), _w(16, 8)), dict(activation="silu", implementation="mosaic_gpu"), "sparse"),
    ((_w(4, 8), _w(8, 16), _w(8, 16, 1), _w(16, 8)), {}, "w_up must have rank 2"),
    ((_w(4, 8), _w(8, 16), _w(9, 16), _w(16, 8)), {}, r"w_up must have shape \[D, H\]"),
    ((_w(4, 8), _w(8, 12), _w(8, 16), _w(16, 8)), {}, "w_gate must have shape"),
    ((_w(4, 8), _w(8, 16), _w(8, 16), _w(8, 16)), {}, "w_down must have shape"),
    # The tensor that disagrees with the others is the one named.
    ((_w(4, 8), _w(8, 16), _w(8, 12), _w(16, 8)), {},
     r"^w_up must have shape \[D, H\] = \(8, 16\) \(H = 16 as in w_gate and w_down\); got \(8, 12\)"),
    ((_w(4, 9), _w(8, 16), _w(8, 16), _w(16, 8)), {},
     r"^x must have shape \[\.\.\., D\] with D = 8 \(the D of w_gate, w_up and w_down\); got \(4, 9\)"),
    ((_w(4, 9), None, _w(8, 16), _w(16, 8)), {}, r"^x must have shape \[\.\.\., D\] with D = 8"),
    ((_w(4, 8), None, _w(8, 16), _w(12, 8)), {},
     r"^the arguments disagree on H: w_up \[D, H\] = \(8, 16\), w_down \[H, D\] = \(12, 8\)"),
    ((_w(4, 8, dtype=jnp.int32), _w(8, 16), _w(8, 16), _w(16, 8)), {}, "x must have dtype"),
    ((_w(4, 8), _w(8, 16), _w(8, 16, dtype=jnp.float32), _w(16, 8)), {}, "w_up has dtype float32 but x has bfloat16"),
    ((jnp.zeros((), jnp.bfloat16), _w(8, 16), _w(8, 16), _w(16, 8)), {}, "rank >= 1"),
    (("not an array", _w(8, 16), _w(8, 16), _w(16, 8)), {}, "x must be an array"),
])
def test_bad_input_raises_value_error(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    tj.ffn(*args, **kwargs)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.float16, 5e-3)])
def test_other_float_dtypes(dtype, tol):
  x, wg, wu, wd = ffn_inputs(jax.random.key(10), 50, 32, 256, active_fraction=0.05,
                             heavy_fraction=0.02, dtype=dtype)
  y, st = tj.ffn(x, wg, wu, wd, implementation="xla", return_stats=True, ell_width=32)
  y_ref, l1_ref = tj.reference_ffn(x, wg, wu, wd)
  assert y.dtype == dtype and _rel(y, y_ref) < tol and _rel(st.l1, l1_ref) < tol
  g = jax.grad(lambda a: jnp.sum(tj.ffn(a, wg, wu, wd, implementation="xla", ell_width=32).astype(F32)))(x)
  g_ref = jax.grad(lambda a: jnp.sum(tj.reference_ffn(a, wg, wu, wd)[0]))(x.astype(F32))
  assert g.dtype == dtype and _rel(g, g_ref) < 10 * tol


def test_mosaic_gpu_in_interpreter_through_public_api():
  """implementation="mosaic_gpu" (and None) with interpret=True run the Pallas kernels on the CPU."""
  x, wg, wu, wd = ffn_inputs(jax.random.key(11), 70, 64, 256, active_fraction=0.05,
                             heavy_fraction=0.03, empty_fraction=0.1)
  y_ref, l1_ref = tj.reference_ffn(x, wg, wu, wd)
  y, st = tj.ffn(x, wg, wu, wd, implementation="mosaic_gpu", interpret=True, return_stats=True)
  assert _rel(y, y_ref) < TOL["y"] and _rel(st.l1, l1_ref) < TOL["y"]
  assert int(st.overflow_rows) >= 3          # the heavy rows overflow their 32-slot tiles
  np.testing.assert_array_equal(np.asarray(st.fired), _active_mask(x, wg, wu).any(0))
  y_auto = tj.ffn(x, wg, wu, wd, interpret=True)   # None picks the kernels when interpreting
  np.testing.assert_array_equal(np.asarray(y_auto, np.float32), np.asarray(y, np.float32))


_IMPLEMENTATIONS = [None, *tj.api.IMPLEMENTATIONS]


@pytest.mark.parametrize("implementation", _IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("kwargs,match", [
    (dict(ell_width=0), r"ell_width must be a Python int >= 1; got 0"),
    (dict(ell_width=-4), r"ell_width must be a Python int >= 1; got -4"),
    (dict(ell_width=2.5), r"ell_width must be a Python int >= 1; got 2.5 \(float\)"),
    (dict(ell_width=True), r"ell_width must be a Python int >= 1; got True \(bool\)"),
    (dict(tail_rows=-1), r"tail_rows must be a Python int >= 0, or None \(M/8\); got -1"),
    (dict(tail_rows=jnp.int32(3)), r"tail_rows must be a Python int >= 0"),
    (dict(interpret="yes"), r"interpret must be True or False; got 'yes'"),
])
def test_bad_option_is_the_same_value_error_for_every_implementation(implementation, kwargs, match):
  """One validation for every implementation: it runs before any of them."""
  x, wg, wu, wd = _w(16, 32), _w(32, 256), _w(32, 256), _w(256, 32)
  kwargs = dict(dict(interpret=True), **kwargs)   # lets mosaic_gpu get past the backend check
  with pytest.raises(ValueError, match=match):
    tj.ffn(x, wg, wu, wd, implementation=implementation, **kwargs)


@pytest.mark.parametrize("implementation", _IMPLEMENTATIONS, ids=str)
def test_bad_shapes_are_the_same_value_error_for_every_implementation(implementation):
  with pytest.raises(ValueError, match=r"D >= 1 and H >= 1"):
    tj.ffn(_w(4, 8), None, _w(8, 0), _w(0, 8), implementation=implementation, interpret=True)
  with pytest.raises(ValueError, match=r"w_down must have shape \[H, D\] = \(16, 8\)"):
    tj.ffn(_w(4, 8), _w(8, 16), _w(8, 16), _w(16, 9), implementation=implementation,
           interpret=True)


def test_zero_tail_rows_is_exact():
  """tail_rows=0 is allowed: any heavy row sends the call to the dense path."""
  x, wg, wu, wd = ffn_inputs(jax.random.key(12), 40, 32, 256, active_fraction=0.05,
                             heavy_fraction=0.1)
  y, st = tj.ffn(x, wg, wu, wd, implementation="xla", ell_width=16, tail_rows=0,
                 return_stats=True)
  assert int(st.overflow_rows) > 0 and _rel(y, tj.reference_ffn(x, wg, wu, wd)[0]) < TOL["y"]


DECODE_CASES = {
    # name: (m, d, h, ffn_inputs kwargs): few rows, as at a decode step; ragged D and H
    # (not multiples of the kernels' blocks) in some.
    "one_row_few_active": (1, 48, 2048, dict(active_fraction=0.01)),
    "rows_with_zero_one_many": (8, 48, 2048, dict(active_fraction=0.004, empty_fraction=0.25,
                                                  heavy_fraction=0.0)),
    "batch_16_hot_features": (16, 64, 2048, dict(active_fraction=0.02, hottest=0.9,
                                                 top_shares=((0.01, 0.5),))),
    "ragged_d_and_h": (5, 72, 600, dict(active_fraction=0.03)),
    "batch_64": (64, 48, 512, dict(active_fraction=0.01)),
    "most_features_dead": (8, 48, 1024, dict(active_fraction=0.01, dead_fraction=0.9)),
    "all_active_rows": (4, 32, 512, dict(active_fraction=0.2, heavy_fraction=0.5,
                                         heavy_fill=1.0)),
}


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_matches_reference_and_dense(case, gated):
  """The decode FFN (interpreted kernels): the f32 reference (forward, stats) and the dense
  FFN of the same dtype (forward; gradients, which are the dense FFN's by construction), on
  rows with no, one, many and all features active."""
  m, d, h, gen = DECODE_CASES[case]
  seed = sorted(DECODE_CASES).index(case)     # fixed: str hashes change between processes
  x, wg, wu, wd = ffn_inputs(jax.random.key(seed), m, d, h, gated=gated, **gen)
  st = _check("decode", x, wg, wu, wd, grads_of="dense", interpret=True)
  active = _active_mask(x, wg, wu)
  np.testing.assert_array_equal(np.asarray(st.fired), active.any(0))
  np.testing.assert_allclose(float(st.nnz_per_token), active.sum(1).mean(), rtol=1e-5)
  y = tj.ffn(x, wg, wu, wd, implementation="decode", interpret=True)
  y_dense = tj.ffn(x, wg, wu, wd, implementation="dense")
  # The same roundings as the dense FFN; only the order of the f32 sums differs.
  assert _rel(y, y_dense.astype(F32)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16, 64])
def test_decode_kernels_on_the_gpu(m):
  """The compiled kernels at the paper's shape: the dense FFN's output, every row."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  x, wg, wu, wd = ffn_inputs(jax.random.key(m), m, 2048, 5632, active_fraction=0.01,
                             hottest=0.9, top_shares=((0.01, 0.5),))
  y = tj.ffn(x, wg, wu, wd, implementation="decode")
  y_dense = tj.ffn(x, wg, wu, wd, implementation="dense")
  assert _rel(y, y_dense.astype(F32)) < 1e-2
  assert _rel(y, tj.reference_ffn(x, wg, wu, wd)[0]) < TOL["y"]


@pytest.mark.gpu
@pytest.mark.parametrize("rows_sum", ["xla", "kernel"])
def test_decode_one_row_kernel_on_the_gpu(rows_sum):
  """The compiled one-row kernel at the paper's shape with either sum of its partials: the
  dense FFN's output."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  from pallas_kernels import decode_ffn_triton  # pylint: disable=import-outside-toplevel
  from twell_jax import decode  # pylint: disable=import-outside-toplevel
  x, wg, wu, wd = ffn_inputs(jax.random.key(3), 1, 2048, 5632, active_fraction=0.005)
  cfg = decode_ffn_triton.DecodeConfig(rows_sum=rows_sum)
  y = decode.decode_ffn_weights(x, decode.DecodeWeights.of(wg, wu, wd), config=cfg)[0]
  y_dense = tj.ffn(x, wg, wu, wd, implementation="dense")
  assert _rel(y, y_dense.astype(F32)) < 1e-2


@pytest.mark.parametrize("m", [1, 3], ids=["one_row_kernel", "tiled_kernels"])
def test_decode_no_feature_fires(m):
  """Every gate pre-activation negative: y is zero, and nothing of W_up or W_down is read
  (a NaN planted there does not show)."""
  x, wg, wu, wd = ffn_inputs(jax.random.key(13), m, 32, 256, active_fraction=0.0)
  assert not _active_mask(x, wg, wu).any()
  wd = wd.at[7, 3].set(jnp.nan)
  y = tj.ffn(x, wg, wu, wd, implementation="decode", interpret=True)
  np.testing.assert_array_equal(np.asarray(y, np.float32), 0.0)


@pytest.mark.parametrize("m", [1, 4], ids=["one_row_kernel", "tiled_kernels"])
def test_decode_non_finite_input_spreads_as_in_dense(m):
  x, wg, wu, wd = ffn_inputs(jax.random.key(11), m, 32, 512, active_fraction=0.01)
  x = x.at[m // 2, 5].set(jnp.inf)
  y = tj.ffn(x, wg, wu, wd, implementation="decode", interpret=True)
  y_dense = tj.ffn(x, wg, wu, wd, implementation="dense")
  np.testing.assert_array_equal(np.isnan(np.asarray(y, np.float32)),
                                np.isnan(np.asarray(y_dense, np.float32)))
  assert np.isnan(np.asarray(y[m // 2], np.float32)).any()


def test_decode_kernels_refuse_mismatched_weights():
  from pallas_kernels import decode_ffn_triton  # pylint: disable=import-outside-toplevel
  x, wg, wu, wd = ffn_inputs(jax.random.key(2), 4, 32, 256)
  with pytest.raises(ValueError, match="bad shapes"):
    decode_ffn_triton.decode_ffn(x, wg.T, wu, wd, interpret=True)   # W_up not transposed


def test_decode_refuses_more_rows_than_it_runs():
  x, wg, wu, wd = ffn_inputs(jax.random.key(1), 65, 32, 256)
  with pytest.raises(NotImplementedError, match="1 to 64 rows"):
    tj.ffn(x, wg, wu, wd, implementation="decode", interpret=True)


@pytest.mark.parametrize("chunk,rows_sum", [(2048, "xla"), (2048, "kernel"), (16, "kernel")],
                         ids=["one_chunk-xla_sum", "one_chunk-kernel_sum",
                              "chunked_d-kernel_sum"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", ["one_row_few_active", "ragged_d_and_h", "all_active_rows",
                                  "most_features_dead", "batch_16_hot_features"])
def test_decode_rows_kernel_matches_reference(case, gated, chunk, rows_sum):
  """The one-kernel path (whole weight rows per program, the down product fused), taken here
  for every row count, D in one chunk and in several (ragged), its partials summed by XLA
  or by the kernel that reads the fired blocks' only: the f32 reference and the dense FFN,
  p and h included."""
  from pallas_kernels import decode_ffn_triton  # pylint: disable=import-outside-toplevel
  from pallas_kernels import reference  # pylint: disable=import-outside-toplevel
  m, d, h, gen = DECODE_CASES[case]
  x, wg, wu, wd = ffn_inputs(jax.random.key(40 + sorted(DECODE_CASES).index(case)), m, d, h,
                             gated=gated, **gen)
  cfg = decode_ffn_triton.DecodeConfig(rows_max=decode_ffn_triton.MAX_ROWS, rows_features=64,
                                       rows_chunk=chunk, rows_sum=rows_sum, rows_sum_cols=16)
  t = lambda w: jnp.swapaxes(w, 0, 1)
  y, p, hid = decode_ffn_triton.decode_ffn(
      x, t(wg) if gated else t(wu), t(wu) if gated else None, wd, config=cfg, interpret=True)
  assert _rel(y, tj.reference_ffn(x, wg, wu, wd)[0]) < TOL["y"]
  np.testing.assert_array_equal(np.asarray(p > 0), _active_mask(x, wg, wu))
  _, h_dense, _ = reference.dense_ffn_hidden(x, wg if gated else None, wu, wd, "relu")
  assert _rel(hid.astype(F32), h_dense.astype(F32)) < 1e-2
  y_dense = tj.ffn(x, wg, wu, wd, implementation="dense")
  assert _rel(y, y_dense.astype(F32)) < 1e-2


@pytest.mark.parametrize("field,value,match", [
    ("block_features", 24, "power of two"), ("rows_chunk", 8, "power of two"),
    ("rows_features", 1, "power of two >= 2"), ("rows_warps", 3, "num_warps"),
    ("rows_max", 65, r"rows_max=65 must be in \[0, 64\]"),
    ("rows_sum", "atomic", "'xla' or 'kernel'"), ("rows_sum_cols", 12, "power of two")])
def test_decode_config_refuses_bad_values(field, value, match):
  from pallas_kernels import decode_ffn_triton  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=match):
    decode_ffn_triton.DecodeConfig(**{field: value})


@pytest.mark.parametrize("implementation", [None, "dense", "xla"], ids=str)
def test_stats_name_the_implementation_that_resolve_implementation_predicts(implementation):
  x, wg, wu, wd = ffn_inputs(jax.random.key(13), 24, 32, 256, active_fraction=0.05)
  x3 = x.reshape(2, 12, 32)
  name = tj.resolve_implementation(x3, wg, wu, wd, implementation=implementation)
  assert name == implementation or (implementation is None and name == "dense")  # the CPU
  _, st = jax.jit(functools.partial(tj.ffn, implementation=implementation, return_stats=True))(
      x3, wg, wu, wd)
  assert st.implementation == name
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  assert tj.resolve_implementation(sds(x3), sds(wg), sds(wu), sds(wd),
                                   implementation=implementation) == name


def test_resolve_implementation_answers_for_a_device_and_refuses_as_ffn_does():
  x, wg, wu, wd = _w(16, 32), _w(32, 256), _w(32, 256), _w(256, 32)
  cpu = jax.devices("cpu")[0]
  assert tj.resolve_implementation(x, wg, wu, wd, device=cpu) == "dense"
  assert tj.resolve_implementation(x, wg, wu, wd, device=cpu, interpret=True) == "mosaic_gpu"
  with jax.default_device(cpu):        # where JAX runs a call of uncommitted arrays
    assert tj.resolve_implementation(x, wg, wu, wd) == "dense"
  with pytest.raises(NotImplementedError, match=r"implementation='mosaic_gpu' cannot run"):
    tj.resolve_implementation(x, wg, wu, wd, implementation="mosaic_gpu", device=cpu)
  with pytest.raises(ValueError, match=r"^w_down must have shape \[H, D\] = \(256, 32\)"):
    tj.resolve_implementation(x, wg, wu, _w(256, 16))
  # No tokens: nothing runs; the statistics still say which implementation was asked for.
  _, st = tj.ffn(_w(0, 32), wg, wu, wd, implementation="xla", return_stats=True)
  assert st.implementation == "xla"


def test_every_implementation_counts_heavy_rows_against_the_calls_ell_width():
  """Only overflow_rows depends on the implementation (docs/layer.md, Statistics)."""
  x, wg, wu, wd = ffn_inputs(jax.random.key(14), 32, 32, 512, active_fraction=0.05,
                             heavy_fraction=0.1)
  stats = {impl: tj.ffn(x, wg, wu, wd, implementation=impl, interpret=True, return_stats=True,
                        ell_width=24)[1] for impl in ("dense", "xla", "decode")}
  for impl, st in stats.items():
    assert st.implementation == impl
    for field in ("nnz_per_token", "max_tile_nnz", "feature_counts", "heavy_rows_by_hot"):
      np.testing.assert_array_equal(getattr(st, field), getattr(stats["dense"], field),
                                    err_msg=f"{impl}: {field}")
  heavy = int(stats["dense"].heavy_rows_by_hot[0])
  assert heavy > 0 and int(stats["xla"].overflow_rows) == heavy
  assert int(stats["dense"].overflow_rows) == int(stats["decode"].overflow_rows) == 0


def test_stats_stack_joins_the_names_of_different_implementations():
  x, wg, wu, wd = ffn_inputs(jax.random.key(15), 16, 32, 256, active_fraction=0.05)
  dense = tj.ffn(x, wg, wu, wd, implementation="dense", return_stats=True)[1]
  xla = tj.ffn(x, wg, wu, wd, implementation="xla", return_stats=True)[1]
  layers = tj.stats.stack([dense, xla, xla])
  assert layers.implementation == "dense+xla" and layers.feature_counts.shape == (3, 256)
  np.testing.assert_array_equal(layers.feature_counts[2], xla.feature_counts)
  same = tj.stats.stack([xla, xla])
  assert same.implementation == "xla" and same.l1.shape == (2,)
  joined = tj.stats.stack([layers, same], concatenate=True)
  assert joined.implementation == "dense+xla" and joined.l1.shape == (5,)
  with pytest.raises(ValueError, match="stats must hold at least one FFNStats"):
    tj.stats.stack([])
