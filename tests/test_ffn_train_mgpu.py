"""Training forward + backward (pallas_kernels/ffn_train_mgpu.py, through
`twell_jax.ffn(implementation="mosaic_gpu")`): gradients against jax.grad of the f32 reference.

* ``TrainInterpretTest``: the kernels under ``plgpu.InterpretGPUParams`` on the CPU (small
  shapes; each kernel launch costs seconds in the interpreter, so the cases are few and tiny).
* ``TrainLoweringTest``: the whole forward + backward lowered for CUDA on any host (the Mosaic
  GPU modules are built at lowering time), including lax.scan + jax.checkpoint.
* ``TrainGpuTest``: the same checks compiled for a Hopper GPU, larger shapes; skipped elsewhere.
The loss is sum(y * ct) + L1_COEFF * stats.l1 with a random cotangent ct, so the L1 term's
gradient is exercised. Inputs come from ``twell_jax.testing.ffn_inputs`` with fixed seeds.
"""

from __future__ import annotations

import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_test_util as ktu
import twell_jax as tj
from twell_jax import mosaic
from twell_jax.testing import ffn_inputs
from pallas_kernels import _common as common
from pallas_kernels import _row_loops as row_loops
from pallas_kernels import ffn_train_mgpu
from pallas_kernels import sparse_backward_mgpu

F32 = jnp.float32
TOL = {"y": 1.5e-2, "grad": 2.5e-2}
L1_COEFF = 0.7


_rel = ktu.rel


def _ffn(x, wg, wu, wd, *, interpret, **kw):
  """The mosaic_gpu implementation with stats, through the public entry point."""
  return tj.ffn(x, wg, wu, wd, implementation="mosaic_gpu", return_stats=True,
                interpret=interpret, **kw)


def check_grads(tc, x, wg, wu, wd, *, interpret, **kw):
  gated = wg is not None
  argnums = (0, 1, 2, 3) if gated else (0, 2, 3)
  ct = jax.random.normal(jax.random.key(17), x.shape, F32)

  def loss(x, wg, wu, wd):
    y, st = _ffn(x, wg, wu, wd, interpret=interpret, **kw)
    return jnp.sum(y.astype(F32) * ct) + L1_COEFF * st.l1, (y, st)

  def ref_loss(x, wg, wu, wd):
    y, l1 = tj.reference_ffn(x, wg, wu, wd)
    return jnp.sum(y * ct) + L1_COEFF * l1, (y, l1)

  (_, (y, st)), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(x, wg, wu, wd)
  f32 = lambda a: None if a is None else a.astype(F32)
  (_, (y_ref, l1_ref)), ref_grads = jax.value_and_grad(ref_loss, argnums, has_aux=True)(
      f32(x), f32(wg), f32(wu), f32(wd))
  tc.assertEqual(y.shape, x.shape)
  tc.assertEqual(y.dtype, x.dtype)
  tc.assertLess(_rel(y, y_ref), TOL["y"])
  tc.assertLess(_rel(st.l1, l1_ref), TOL["y"])
  for i, g, r in zip(argnums, grads, ref_grads):
    tc.assertEqual(g.dtype, (x, wg, wu, wd)[i].dtype)
    tc.assertLess(_rel(g, r), TOL["grad"], f"gradient of argument {i}")
  # Stats (training forward): activity from the f32 gate pre-activations.
  pre = np.asarray(f32(x) @ f32(wg if gated else wu))
  act = pre > 0
  np.testing.assert_allclose(float(st.nnz_per_token), act.sum(1).mean(), rtol=1e-3)
  return st, act


TrainTestBase = ktu.KernelTestBase


class TrainInterpretTest(TrainTestBase):
  INTERPRET = True

  @parameterized.named_parameters(
      # ELL rows only, 20% all-zero rows.
      dict(testcase_name="gated_ell_zero_rows", m=128, d=128, h=256,
           gen=dict(active_fraction=0.03, empty_fraction=0.2), kw={}),
      # Odd shapes (padding of M, D, H); rows over the ELL width and rows with an overflowing
      # TwELL tile go to the dense tail; some all-zero rows.
      dict(testcase_name="gated_odd_heavy_tail", m=70, d=96, h=300,
           gen=dict(active_fraction=0.03, heavy_fraction=0.05, empty_fraction=0.05),
           kw=dict(ell_width=12)),
      # More heavy rows than the tail holds: the on-device dense fallback.
      dict(testcase_name="gated_over_tail_capacity", m=64, d=64, h=256,
           gen=dict(active_fraction=0.05, heavy_fraction=0.2), kw=dict(ell_width=16, tail_rows=4)),
      dict(testcase_name="nongated_heavy_tail", m=100, d=64, h=256,
           gen=dict(active_fraction=0.04, heavy_fraction=0.03), kw=dict(ell_width=16),
           gated=False),
      # Real L1-trained activity: a feature on 70% of the rows, 80% of the features dead,
      # heavy-tailed rows; the first 256 features run as dense products.
      dict(testcase_name="gated_skewed_hot_features", m=128, d=64, h=512,
           gen=dict(active_fraction=0.02, dead_fraction=0.8, hottest=0.7, row_spread=0.5,
                    heavy_fraction=0.02), kw=dict(ell_width=16, hot_features=256)),
  )
  def test_grads_match_reference(self, m, d, h, gen, kw, gated=True):
    x, wg, wu, wd = ffn_inputs(jax.random.key(23), m, d, h,
                               gated=gated, **gen)
    st, act = check_grads(self, x, wg, wu, wd, interpret=True, **kw)
    width, k = kw.get("ell_width", 128), kw.get("hot_features", 0)
    cold = act[:, k:]        # heavy rows are counted on the packed (cold) features only
    tiles = np.pad(cold, ((0, 0), (0, -cold.shape[1] % 256))).reshape(m, -1, 256).sum(-1)
    expect_heavy = int(((cold.sum(1) > width) | (tiles > 32).any(1)).sum())
    self.assertEqual(int(st.overflow_rows), expect_heavy)
    if gen.get("heavy_fraction"):
      self.assertGreater(expect_heavy, 0)
    if "tail_rows" in kw:
      self.assertGreater(expect_heavy, kw["tail_rows"])

  def test_hot_features_and_column_pieces_change_nothing_but_rounding(self):
    """Any number of hot features computes the same function, forward and backward: K = 0
    (all through the gather kernels) with long columns cut in pieces, against 256 and all 512
    (nothing cut). 504 ELL entries (10 rows heavy, in a tail of 16); pieces of at most
    max(16, 504 / 64) = 16 entries cut the columns of 20, 32 and 43, whose weight gradients
    are also checked alone against the f32 reference (in the whole gradient the heavy rows'
    share would hide them)."""
    m, d, h = 64, 64, 512
    x, wg, wu, wd = ffn_inputs(jax.random.key(31), m, d, h, active_fraction=0.02,
                               dead_fraction=0.5, hottest=0.8, heavy_fraction=0.03)
    dy = jax.random.normal(jax.random.key(8), (m, d), jnp.bfloat16)

    def run(k, **kw):
      cfg = ffn_train_mgpu.hybrid_config(m, d, h, ell_width=16, tail_rows=16, hot_features=k,
                                         **kw)
      out, res = ffn_train_mgpu.forward(cfg, x, wg, wu, wd, interpret=True)
      ct = (dy, dict(out[1], l1=jnp.float32(0.5)))
      return out, ffn_train_mgpu.backward(cfg, res, ct, interpret=True)

    (y0, st0), g0 = run(0, column_pieces=sparse_backward_mgpu.PieceConfig(length=16, extra=64))
    f32 = lambda a: a.astype(F32)

    def ref_loss(wg, wu, wd):
      y, l1 = tj.reference_ffn(f32(x), wg, wu, wd)
      return jnp.sum(y * f32(dy)) + 0.5 * l1

    ref = jax.grad(ref_loss, argnums=(0, 1, 2))(f32(wg), f32(wu), f32(wd))
    top = np.argsort(np.asarray(st0["feature_counts"]))[-8:]   # the cut columns among them
    for name, a, r in (("w_gate", g0[1][:, top], ref[0][:, top]),
                       ("w_up", g0[2][:, top], ref[1][:, top]),
                       ("w_down", g0[3][top], ref[2][top])):
      self.assertLess(_rel(a, r), TOL["grad"], name)
    for k in (256, 512):
      (y, st), g = run(k)
      self.assertLess(_rel(y, y0), 1e-2, k)
      self.assertLess(_rel(st["l1"], st0["l1"]), 1e-3, k)
      for key in ("feature_counts", "nnz_per_token", "max_tile_nnz"):
        np.testing.assert_array_equal(np.asarray(st[key]), np.asarray(st0[key]), key)
      for a, b in zip(g, g0):
        self.assertLess(_rel(a, b), 1e-2, k)

  def test_config_rejects_bad_sizes(self):
    with self.assertRaisesRegex(ValueError, "HybridConfig"):
      ffn_train_mgpu.HybridConfig(m=64, d=64, h=256, ell_width=0, tail_rows=8)
    for k in (-256, 128):
      with self.assertRaisesRegex(ValueError, "hot_features"):
        ffn_train_mgpu.HybridConfig(m=64, d=64, h=256, ell_width=8, tail_rows=8, hot_features=k)

  def test_kernel_variants_same_bits(self):
    """Where x / dy rows live (registers f32 / bf16, or reloaded), each kernel's group, dh on
    the column or the row side and rows loaded a step ahead (or not) change the schedule only:
    forward and backward give the default's bits."""
    m, d, h = 64, 128, 256
    x, wg, wu, wd = ffn_inputs(jax.random.key(21), m, d, h, active_fraction=0.04,
                               heavy_fraction=0.03)
    dy = jax.random.normal(jax.random.key(7), (m, d), jnp.bfloat16)
    g = row_loops.GatherConfig

    def run(**kw):
      cfg = ffn_train_mgpu.hybrid_config(m, d, h, ell_width=16, **kw)
      out, res = ffn_train_mgpu.forward(cfg, x, wg, wu, wd, interpret=True)
      ct = (dy, dict(out[1], l1=jnp.float32(1.0)))
      return jax.tree.leaves((out, ffn_train_mgpu.backward(cfg, res, ct, interpret=True)))

    base = run()
    # Every non-default choice in two runs (dh on the column side or the row side): each run
    # costs seconds in the interpreter.
    for kw in (dict(up_down=g(row_mode="bf16"), dx=g(group=2), wgrads=g(group=2),
                    down_dh=g(group=2, rows_ahead=True)),
               dict(dh_in_columns=False, dh=g(row_mode="reload"),
                    wgrads=g(group=2, rows_ahead=True))):
      for a, b in zip(run(**kw), base, strict=True):
        np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(b, F32), err_msg=str(kw))

  def test_gradient_accumulation(self):
    """Gradients summed over 2 micro-batches inside lax.scan (jit), vs the f32 reference."""
    m, d, h = 64, 64, 256
    key = jax.random.key(23)
    x0, wg, wu, wd = ffn_inputs(key, m, d, h, active_fraction=0.04, heavy_fraction=0.05)
    x1 = ffn_inputs(jax.random.fold_in(key, 1), m, d, h, active_fraction=0.04)[0]
    xs = jnp.stack([x0, x1])

    def loss_ours(w, x):
      y, st = _ffn(x, *w, interpret=True, ell_width=16)
      return jnp.sum(y.astype(F32) ** 2) / m + L1_COEFF * st.l1

    def loss_ref(w, x):
      y, l1 = tj.reference_ffn(x, *w)
      return jnp.sum(y ** 2) / m + L1_COEFF * l1

    def accumulate(loss, w, xs):
      g0 = jax.tree.map(lambda a: jnp.zeros(a.shape, F32), w)
      def step(acc, x):
        return jax.tree.map(lambda a, b: a + b.astype(F32), acc, jax.grad(loss)(w, x)), None
      return jax.lax.scan(step, g0, xs)[0]

    grads = jax.jit(functools.partial(accumulate, loss_ours))((wg, wu, wd), xs)
    f32 = lambda a: a.astype(F32)
    ref = accumulate(loss_ref, (f32(wg), f32(wu), f32(wd)), f32(xs))
    for g, r in zip(grads, ref):
      self.assertLess(_rel(g, r), 4e-2)


class CscTest(parameterized.TestCase):
  """The column-order permutation of the ELL entries (16-bit or 32-bit sort keys)."""

  @parameterized.parameters(512, 70000)
  def test_csc_is_a_stable_column_sort(self, h):
    rng = np.random.default_rng(3)
    cfg = ffn_train_mgpu.hybrid_config(40, 64, h, ell_width=16)
    cols = jnp.asarray(rng.integers(0, h, (cfg.mp, cfg.wk)), jnp.int32)
    n = jnp.asarray(rng.integers(0, cfg.wk + 1, (cfg.mp,)), jnp.int32)
    col_ptr, sid = ffn_train_mgpu._csc(cfg, cols, n)  # pylint: disable=protected-access
    valid = np.arange(cfg.wk)[None, :] < np.asarray(n)[:, None]
    key = np.where(valid, np.asarray(cols), cfg.hp).reshape(-1)
    np.testing.assert_array_equal(np.asarray(sid), np.argsort(key, kind="stable"))
    hist = np.bincount(key[key < cfg.hp], minlength=cfg.hp)
    np.testing.assert_array_equal(np.asarray(col_ptr), np.concatenate([[0], np.cumsum(hist)]))


  def test_first_true_is_nonzero(self):
    """The tail index (heavy rows in order, padded with M) equals jnp.nonzero's, with fewer,
    as many and more True entries than slots."""
    rng = np.random.default_rng(29)
    for n, size, frac in ((100, 8, 0.05), (100, 8, 0.5), (50, 4, 0.0), (30, 30, 1.0)):
      mask = rng.random(n) < frac
      got = common.first_true(jnp.asarray(mask), size, fill=n)
      (want,) = jnp.nonzero(mask, size=size, fill_value=n)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(mask))


class TrainLoweringTest(parameterized.TestCase):
  """Builds the Mosaic GPU modules of forward + backward for CUDA on any host (no GPU needed)."""

  @parameterized.parameters(True, False)
  def test_fwd_bwd_lowers_for_cuda(self, gated):
    x, wg, wu, wd = ffn_inputs(jax.random.key(0), 256, 256, 512, gated=gated)
    cfg = ffn_train_mgpu.hybrid_config(256, 256, 512)

    def f(x, wg, wu, wd, dy):
      out, res = ffn_train_mgpu.forward(cfg, x, wg, wu, wd)
      return out, ffn_train_mgpu.backward(cfg, res, (dy, dict(out[1], l1=jnp.float32(1.0))))

    ktu.lower_for_cuda(f, x, wg, wu, wd, x)

  def test_kernel_variants_lower_for_cuda(self):
    # D = 2048: f32 and bf16 rows get different register layouts only from D = 512 up.
    x, wg, wu, wd = ffn_inputs(jax.random.key(0), 256, 2048, 512)
    g = row_loops.GatherConfig
    cfg = ffn_train_mgpu.hybrid_config(256, 2048, 512, up_down=g(row_mode="reload"),
                                       dh=g(row_mode="bf16"), wgrads=g(rows_ahead=True),
                                       dh_in_columns=False)

    def f(x, wg, wu, wd, dy):
      out, res = ffn_train_mgpu.forward(cfg, x, wg, wu, wd)
      return out, ffn_train_mgpu.backward(cfg, res, (dy, dict(out[1], l1=jnp.float32(1.0))))

    ktu.lower_for_cuda(f, x, wg, wu, wd, x)

  def test_layers_with_other_hot_features_share_their_kernels(self):
    """Forward + backward of three layers with K = 256, 512 and 768 hold the same Mosaic GPU
    kernels as one layer: K reaches the gate kernel at run time and every kernel call is
    jitted, so the layers share each kernel, lowered and compiled once per train step
    (without either, each K had kernels of its own: 25 at the paper shape's mixed K, 45 s
    to build against 9 s for one K on an H100)."""
    x, wg, wu, wd = ffn_inputs(jax.random.key(0), 256, 256, 1024)

    def layers(hot):
      def f(x, wg, wu, wd, dy):
        grads = []
        for k in hot:
          cfg = ffn_train_mgpu.hybrid_config(256, 256, 1024, hot_features=k)
          out, res = ffn_train_mgpu.forward(cfg, x, wg, wu, wd)
          grads.append(ffn_train_mgpu.backward(cfg, res, (dy, dict(out[1], l1=jnp.float32(1.0)))))
        return grads
      text = ktu.lower_for_cuda(f, x, wg, wu, wd, x).as_text()
      return (len(re.findall(r"custom_call @mosaic_gpu", text)),
              sorted(re.findall(r'kernel_hash = "([^"]*)"', text)))

    one, hashes = layers((256,))
    self.assertGreaterEqual(one, 4)   # gate, up_down, down_dh, column sums, dx
    three, hashes_of_three = layers((256, 512, 768))
    self.assertEqual(three, one)
    # The second program's kernels hash as the first's, so a process compiles them once
    # (`pallas_kernels._common.stable_kernel_ids`; without it each module's name carried a
    # lowering counter and every hash differed).
    self.assertLen(hashes, one)
    self.assertEqual(hashes_of_three, hashes)

  def test_scan_checkpoint_grad_lowers_for_cuda(self):
    x, wg, wu, wd = ffn_inputs(jax.random.key(0), 128, 128, 256)
    stack = lambda a: jnp.stack([a, a])

    def loss(x, ws):
      def layer(h_, w):
        y, st = mosaic.mosaic_ffn(h_, *w, interpret=False, ell_width=128, tail_rows=None)
        return h_ + y, st.l1
      out, l1 = jax.lax.scan(jax.checkpoint(layer), x, ws)
      return jnp.sum(out.astype(F32)) + jnp.sum(l1)

    ktu.lower_for_cuda(jax.grad(loss, argnums=(0, 1)), x,
                          (stack(wg), stack(wu), stack(wd)))


@pytest.mark.gpu
class TrainGpuTest(TrainTestBase):
  INTERPRET = False

  @parameterized.named_parameters(
      dict(testcase_name="gated_ell", m=2048, d=512, h=1024,
           gen=dict(active_fraction=0.02, empty_fraction=0.05), kw={}),
      dict(testcase_name="gated_odd_heavy_tail", m=1000, d=200, h=700,
           gen=dict(active_fraction=0.02, heavy_fraction=0.02), kw=dict(ell_width=32)),
      dict(testcase_name="gated_over_capacity", m=512, d=256, h=512,
           gen=dict(active_fraction=0.02, heavy_fraction=0.1), kw=dict(tail_rows=16)),
      dict(testcase_name="nongated_heavy", m=1024, d=256, h=1024,
           gen=dict(active_fraction=0.02, heavy_fraction=0.01), kw={}, gated=False),
      dict(testcase_name="paper_shape", m=4096, d=2048, h=5632,
           gen=dict(active_fraction=30 / 5632, heavy_fraction=0.01), kw={}),
      dict(testcase_name="paper_shape_skewed", m=4096, d=2048, h=5632,
           gen=dict(active_fraction=30 / 5632, heavy_fraction=0.01, dead_fraction=0.75,
                    hottest=0.7, row_spread=0.5), kw={}),
  )
  def test_grads_match_reference(self, m, d, h, gen, kw, gated=True):
    x, wg, wu, wd = ffn_inputs(jax.random.key(23), m, d, h,
                               gated=gated, **gen)
    check_grads(self, x, wg, wu, wd, interpret=False, **kw)

  def test_scan_checkpoint_grad_accumulation(self):
    """2 layers under lax.scan + checkpoint, gradients accumulated over 2 micro-batches."""
    layers, m, d, h = 2, 1024, 256, 1024
    keys = jax.random.split(jax.random.key(3), layers + 1)
    ws = [ffn_inputs(k, m, d, h, active_fraction=0.02, heavy_fraction=0.01) for k in keys[:-1]]
    xs = jnp.stack([ws[0][0], ffn_inputs(keys[-1], m, d, h)[0]])
    stack = lambda i: jnp.stack([w[i] for w in ws])
    params = (stack(1), stack(2), stack(3))

    def model(ffn):
      def run(params, x):
        def layer(carry, w):
          h_, l1 = carry
          y, l1_i = ffn(h_, *w)
          return (h_ + y.astype(h_.dtype), l1 + l1_i), None
        (out, l1), _ = jax.lax.scan(jax.checkpoint(layer), (x, jnp.zeros((), F32)), params)
        return jnp.sum(out.astype(F32) ** 2) / m + L1_COEFF * l1
      return run

    def ours(h_, a, b, c):
      y, st = _ffn(h_, a, b, c, interpret=False)
      return y, st.l1

    def ref(h_, a, b, c):
      y, l1 = tj.reference_ffn(h_.astype(F32), a, b, c)
      return y.astype(h_.dtype), l1

    def accumulate(fn, params, xs):
      g0 = jax.tree.map(lambda a: jnp.zeros(a.shape, F32), params)
      def step(acc, x):
        g = jax.grad(fn)(params, x)
        return jax.tree.map(lambda a, b: a + b.astype(F32), acc, g), None
      return jax.lax.scan(step, g0, xs)[0]

    grads = jax.jit(functools.partial(accumulate, model(ours)))(params, xs)
    ref_grads = accumulate(model(ref), jax.tree.map(lambda a: a.astype(F32), params), xs)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      self.assertLess(_rel(g, r), 4e-2)


if __name__ == "__main__":
  absltest.main()
