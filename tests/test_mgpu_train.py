"""Training (forward + backward) Mosaic GPU kernels: gradients against jax.grad of the f32 dense reference.

* ``TrainInterpretTest``: the kernels under ``plgpu.InterpretGPUParams`` on the CPU (small
  shapes; each kernel launch costs seconds in the interpreter, so the cases are few and tiny).
* ``TrainLoweringTest``: the whole forward + backward lowered for CUDA on any host (the Mosaic
  GPU modules are built at lowering time), including lax.scan + jax.checkpoint.
* ``TrainGpuTest``: the same checks compiled for a Hopper GPU, larger shapes; skipped elsewhere.
The loss is sum(y * ct) + L1_COEFF * stats.l1 with a random cotangent ct, so the L1 term's
gradient is exercised. Inputs come fresh from ``twell_jax.testing.ffn_inputs``.
"""

from __future__ import annotations

import functools
import time

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj
from twell_jax import mosaic
from twell_jax.testing import ffn_inputs
from pallas_kernels import common
from pallas_kernels import ffn_mgpu
from pallas_kernels import ffn_train_mgpu

F32 = jnp.float32
TOL = {"y": 1.5e-2, "grad": 2.5e-2}
L1_COEFF = 0.7


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite values"
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _ffn(x, wg, wu, wd, *, interpret, **kw):
  """The mosaic_gpu implementation with stats, through the public entry point."""
  return tj.ffn(x, wg, wu, wd, implementation="mosaic_gpu", return_stats=True,
                interpret=interpret, **kw)


def check_grads(tc, x, wg, wu, wd, *, interpret, **kw):
  gated = wg is not None
  argnums = (0, 1, 2, 3) if gated else (0, 2, 3)
  ct = jax.random.normal(jax.random.key(int(time.time_ns() % 2**31)), x.shape, F32)

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


class TrainTestBase(parameterized.TestCase):
  INTERPRET = False

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and not common.on_hopper():
      self.skipTest("needs a Hopper GPU")


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
  )
  def test_grads_match_reference(self, m, d, h, gen, kw, gated=True):
    x, wg, wu, wd = ffn_inputs(jax.random.key(int(time.time_ns() % 2**31)), m, d, h,
                               gated=gated, **gen)
    st, act = check_grads(self, x, wg, wu, wd, interpret=True, **kw)
    width = kw.get("ell_width", 128)
    tiles = np.pad(act, ((0, 0), (0, -h % 256))).reshape(m, -1, 256).sum(-1)
    expect_heavy = int(((act.sum(1) > width) | (tiles > 32).any(1)).sum())
    self.assertEqual(int(st.overflow_rows), expect_heavy)
    if gen.get("heavy_fraction"):
      self.assertGreater(expect_heavy, 0)
    if "tail_rows" in kw:
      self.assertGreater(expect_heavy, kw["tail_rows"])

  @parameterized.parameters(True, False)
  def test_bwd_rows_split_matches_reference(self, gated):
    """The two-pass row backward (dh, then dx) against a numpy reference and the one-pass kernel."""
    from pallas_kernels import train_bwd_mgpu  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(int(time.time_ns() % 2**31))
    m, d, h, wk = 16, 128, 256, 8
    n = rng.integers(0, wk + 1, m).astype(np.int32)
    n[0], n[1] = 0, wk                                   # an empty row and a full row
    cols = np.stack([rng.choice(h, wk, replace=False) for _ in range(m)]).astype(np.int32)
    valid = np.arange(wk)[None, :] < n[:, None]
    cols = np.where(valid, cols, 0)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(F32))
    p = bf(np.where(valid, np.abs(rng.normal(size=(m, wk))) + 0.1, 0))
    u = bf(np.where(valid, rng.normal(size=(m, wk)), 0))
    dy, wd, wut, wgt = (bf(rng.normal(size=s_)) for s_ in ((m, d), (h, d), (h, d), (h, d)))
    c = np.float32(0.3)
    b16 = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (b16(dy), jnp.asarray(cols), b16(p), b16(u) if gated else None, jnp.asarray(n),
            jnp.full((1,), c, F32), b16(wd), b16(wut), b16(wgt) if gated else None)
    dx, du, dg = train_bwd_mgpu.ell_bwd_rows(*args, interpret=True)
    dx1, du1, dg1 = train_bwd_mgpu.ell_bwd_rows(*args, split=False, interpret=True)
    hv = bf(p * u) if gated else p
    dh = np.where(valid, np.einsum("md,mkd->mk", dy, wd[cols]) + c * np.sign(hv), 0)
    dg_ref = dh * u if gated else dh
    dx_ref = np.einsum("mk,mkd->md", dg_ref, wgt[cols] if gated else wut[cols])
    if gated:
      du_ref = dh * p
      dx_ref += np.einsum("mk,mkd->md", du_ref, wut[cols])
      np.testing.assert_allclose(np.where(valid, du, 0), du_ref, rtol=1e-4, atol=1e-3)
      np.testing.assert_allclose(np.where(valid, du, 0), np.where(valid, du1, 0), rtol=1e-6)
    np.testing.assert_allclose(np.where(valid, dg, 0), dg_ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.where(valid, dg, 0), np.where(valid, dg1, 0), rtol=1e-6)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dx, dx1, rtol=1e-5, atol=1e-5)

  def test_ell_dx_ignores_unwritten_slots(self):
    """csc_down_dh leaves ELL slots past a row's count unwritten: ell_dx must not read them
    into dx (NaN there must not reach the result)."""
    from pallas_kernels import train_bwd_mgpu  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(int(time.time_ns() % 2**31))
    m, d, h, wk = 8, 128, 256, 6
    n = rng.integers(0, wk + 1, m).astype(np.int32)
    n[0], n[1] = 0, wk
    cols = jnp.asarray(rng.integers(0, h, (m, wk)), jnp.int32)
    valid = np.arange(wk)[None, :] < n[:, None]
    du, dg = (rng.normal(size=(m, wk)).astype(F32) for _ in range(2))
    wut, wgt = (jnp.asarray(rng.normal(size=(h, d)), jnp.bfloat16) for _ in range(2))
    run = lambda a, b: train_bwd_mgpu.ell_dx(cols, jnp.asarray(n), jnp.asarray(a), jnp.asarray(b),
                                             wut, wgt, interpret=True)
    clean = run(np.where(valid, du, 0), np.where(valid, dg, 0))
    dirty = run(np.where(valid, du, np.nan), np.where(valid, dg, np.nan))
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
    self.assertTrue(np.isfinite(np.asarray(clean)).all())

  def test_column_kernels_match_reference_and_round_once(self):
    """The column-side kernels against numpy: csc_weight_grads (1 and 2 kernels) and
    csc_down_dh, whose gate / up values are read from ELL-order arrays through ids (so the
    ELL layout here is a shuffled one, with slots no entry names holding NaN). Every kernel
    sums in f32 and rounds once as it writes: the bf16 outputs are the f32 outputs rounded."""
    from pallas_kernels import train_bwd_mgpu  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(int(time.time_ns() % 2**31))
    m, d, h, e = 8, 128, 6, 20
    rows = rng.integers(0, m, e).astype(np.int32)
    counts = rng.multinomial(e, np.ones(h) / h)
    counts[0] = 0                                      # an empty column
    counts[1] += e - counts.sum()
    col_ptr = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
    seg = np.repeat(np.arange(h), counts)
    x, dy, wd = (rng.normal(size=s_).astype(F32) for s_ in ((m, d), (m, d), (h, d)))
    b16 = lambda a: jnp.asarray(a, jnp.bfloat16)
    bf = lambda a: np.asarray(b16(a).astype(F32))
    x, dy, wd = bf(x), bf(dy), bf(wd)
    # CSC entry i sits at ELL slot ids[i] of a [4, 8] layout (32 slots; 12 unused: NaN).
    ell_shape = (4, 8)
    ids = rng.permutation(32)[:e].astype(np.int32)
    p_csc = bf(np.where(rng.random(e) < 0.2, 0.0, np.abs(rng.normal(size=e)) + 0.1))
    u_csc = bf(rng.normal(size=e))
    p_ell, u_ell = (np.full(32, np.nan, F32) for _ in range(2))
    p_ell[ids], u_ell[ids] = p_csc, u_csc
    c = 0.3
    du, dg = (rng.normal(size=e).astype(F32) for _ in range(2))
    hh = bf(p_csc * u_csc)
    ref = lambda coef, a: np.stack([(coef[seg == j, None] * a[rows[seg == j]]).sum(0)
                                    for j in range(h)])
    dh = np.where(p_csc > 0, np.einsum("ed,ed->e", dy[rows], wd[seg]) + c * np.sign(hh), 0)
    args = lambda *a: tuple(jnp.asarray(v) for v in a)
    cols_args = args(b16(x), b16(dy), col_ptr, rows, du, dg, hh)
    runs = {
        "cols": (lambda dt: train_bwd_mgpu.csc_weight_grads(
            *cols_args, group=2, out_dtype=dt, interpret=True),
                 (ref(du, x), ref(dg, x), ref(hh, dy))),
        "cols_one": (lambda dt: train_bwd_mgpu.csc_weight_grads(
            *cols_args, group=2, kernels=2, out_dtype=dt, interpret=True),
                     (ref(du, x), ref(dg, x), ref(hh, dy))),
        # Rows loaded one step ahead (group 1: every column's loop runs past its end).
        "cols_one_ahead": (lambda dt: train_bwd_mgpu.csc_weight_grads(
            *cols_args, group=1, kernels=2, rows_ahead=True, out_dtype=dt, interpret=True),
                           (ref(du, x), ref(dg, x), ref(hh, dy))),
    }
    for name, group, ahead in (("down_dh", 2, False), ("down_dh_ahead", 1, True)):
      runs[name] = (functools.partial(
          lambda dt, group, ahead: train_bwd_mgpu.csc_down_dh(
              b16(dy), b16(wd), col_ptr, jnp.asarray(rows), b16(p_ell).reshape(ell_shape),
              b16(u_ell).reshape(ell_shape), jnp.full((1,), c, F32), jnp.asarray(ids),
              ell_shape, group=group, rows_ahead=ahead, out_dtype=dt, interpret=True),
          group=group, ahead=ahead), (ref(hh, dy), dh * p_csc, dh * u_csc))
    for name, (run, refs) in runs.items():
      full, rounded = run(F32), run(jnp.bfloat16)
      for i, (a, r) in enumerate(zip(full, refs)):
        np.testing.assert_allclose(np.asarray(a), r, rtol=1e-4, atol=1e-4, err_msg=f"{name} {i}")
      self.assertEqual(rounded[0].dtype, jnp.bfloat16, name)
      np.testing.assert_array_equal(np.asarray(rounded[0]),
                                    np.asarray(full[0].astype(jnp.bfloat16)), err_msg=name)
      if name.startswith("down_dh"):   # du, dg also in ELL order, at ids
        for a_ell, a_csc in ((full[3], full[1]), (full[4], full[2])):
          np.testing.assert_array_equal(np.asarray(a_ell).reshape(-1)[ids], np.asarray(a_csc))
      else:
        for a, b in zip(full[1:], rounded[1:]):
          np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16)))

  def test_config_rejects_unknown_rows_ahead_kernel(self):
    with self.assertRaisesRegex(ValueError, "rows_ahead"):
      ffn_train_mgpu.make_config(64, 64, 256, rows_ahead=("down",))

  def test_csc_down_dh_rejects_unknown_diagnostic(self):
    from pallas_kernels import train_bwd_mgpu  # pylint: disable=import-outside-toplevel
    z = jnp.zeros((8,), F32)
    with self.assertRaisesRegex(ValueError, "diagnostic"):
      train_bwd_mgpu.csc_down_dh(jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((4, 128), jnp.bfloat16),
                                 jnp.zeros((5,), jnp.int32), jnp.zeros((8,), jnp.int32),
                                 z.reshape(8, 1), z.reshape(8, 1), jnp.zeros((1,), F32),
                                 jnp.zeros((8,), jnp.int32), (8, 1),
                                 diagnostic="no_dots", interpret=True)

  def test_kernel_variants_same_bits(self):
    """Where x / dy rows live (registers f32 / bf16, or reloaded), the weight gradients in 1-3
    kernels, their group, dh on the column side and rows loaded a step ahead (or not) change
    the schedule only: forward and backward give the default's bits."""
    m, d, h = 64, 128, 256
    x, wg, wu, wd = ffn_inputs(jax.random.key(int(time.time_ns() % 2**31)), m, d, h,
                               active_fraction=0.04, heavy_fraction=0.03)
    dy = jax.random.normal(jax.random.key(7), (m, d), jnp.bfloat16)

    def run(**kw):
      cfg = ffn_train_mgpu.make_config(m, d, h, ell_width=16, **kw)
      out, res = ffn_train_mgpu.forward(cfg, x, wg, wu, wd, interpret=True)
      return jax.tree.leaves((out, ffn_train_mgpu.backward(cfg, res, (dy, jnp.float32(1.0)),
                                                           interpret=True)))

    base = run()
    for kw in (dict(x_mode="bf16"), dict(wgrads_group=2), dict(dh_group=2),
               # Rows a step ahead in every gather kernel, or in none: whichever is not
               # the default.
               dict(rows_ahead=() if ffn_train_mgpu.TrainConfig.rows_ahead
                    else ffn_train_mgpu.ROWS_AHEAD_KERNELS),
               dict(dh_in_columns=False), dict(dh_in_columns=False, x_mode="reload",
                                                wgrads_kernels=1),
               dict(dh_in_columns=False, wgrads_kernels=3, wgrads_group=2)):
      for a, b in zip(run(**kw), base, strict=True):
        np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(b, F32), err_msg=str(kw))

  def test_scan_over_layers(self):
    """lax.scan over 2 layers' stacked weights vs the f32 reference.

    (No jax.checkpoint here: the interpreter runs kernels through ordered io_callbacks, which
    remat's AD rejects; checkpoint is covered by the lowering test and the GPU test.)
    """
    layers, m, d, h = 2, 64, 64, 256
    ws = [ffn_inputs(k, m, d, h, active_fraction=0.04)
          for k in jax.random.split(jax.random.key(int(time.time_ns() % 2**31)), layers)]
    x = ws[0][0]
    stack = lambda i: jnp.stack([w[i] for w in ws])
    wg, wu, wd = stack(1), stack(2), stack(3)

    def model(ffn):
      def run(x, wg, wu, wd):
        def layer(carry, w):
          h_, l1 = carry
          y, l1_i = ffn(h_, *w)
          return (h_ + y.astype(h_.dtype), l1 + l1_i), None
        (out, l1), _ = jax.lax.scan(layer, (x, jnp.zeros((), F32)), (wg, wu, wd))
        return jnp.sum(out.astype(F32) ** 2) / m + L1_COEFF * l1
      return run

    def ours(h_, a, b, c):
      y, st = _ffn(h_, a, b, c, interpret=True)
      return y, st.l1

    def ref(h_, a, b, c):
      y, l1 = tj.reference_ffn(h_.astype(F32), a, b, c)
      return y.astype(h_.dtype), l1

    grads = jax.jit(jax.grad(model(ours), argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
    f32 = lambda a: a.astype(F32)
    ref_grads = jax.grad(model(ref), argnums=(0, 1, 2, 3))(f32(x), f32(wg), f32(wu), f32(wd))
    for g, r in zip(grads, ref_grads):
      self.assertLess(_rel(g, r), 4e-2)

  def test_gradient_accumulation(self):
    """Gradients summed over 2 micro-batches inside lax.scan (jit), vs the f32 reference."""
    m, d, h = 64, 64, 256
    key = jax.random.key(int(time.time_ns() % 2**31))
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
    cfg = ffn_train_mgpu.make_config(40, 64, h, ell_width=16)
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
    rng = np.random.default_rng(int(time.time_ns() % 2**31))
    for n, size, frac in ((100, 8, 0.05), (100, 8, 0.5), (50, 4, 0.0), (30, 30, 1.0)):
      mask = rng.random(n) < frac
      got = ffn_train_mgpu._first_true(jnp.asarray(mask), size, fill=n)  # pylint: disable=protected-access
      (want,) = jnp.nonzero(mask, size=size, fill_value=n)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(mask))


class TrainLoweringTest(parameterized.TestCase):
  """Builds the Mosaic GPU modules of forward + backward for CUDA on any host (no GPU needed)."""

  @parameterized.parameters(True, False)
  def test_fwd_bwd_lowers_for_cuda(self, gated):
    x, wg, wu, wd = ffn_inputs(jax.random.key(0), 256, 256, 512, gated=gated)
    cfg = ffn_train_mgpu.make_config(256, 256, 512)

    def f(x, wg, wu, wd, dy):
      out, res = ffn_train_mgpu.forward(cfg, x, wg, wu, wd)
      return out, ffn_train_mgpu.backward(cfg, res, (dy, jnp.float32(1.0)))

    common.lower_for_cuda(f, x, wg, wu, wd, x)

  def test_kernel_variants_lower_for_cuda(self):
    # D = 2048: f32 and bf16 rows get different register layouts only from D = 512 up.
    x, wg, wu, wd = ffn_inputs(jax.random.key(0), 256, 2048, 512)
    cfg = ffn_train_mgpu.make_config(256, 2048, 512, x_mode="reload", wgrads_kernels=3,
                                     dh_in_columns=False)

    def f(x, wg, wu, wd, dy):
      out, res = ffn_train_mgpu.forward(cfg, x, wg, wu, wd)
      return out, ffn_train_mgpu.backward(cfg, res, (dy, jnp.float32(1.0)))

    common.lower_for_cuda(f, x, wg, wu, wd, x)

  def test_scan_checkpoint_grad_lowers_for_cuda(self):
    x, wg, wu, wd = ffn_inputs(jax.random.key(0), 128, 128, 256)
    stack = lambda a: jnp.stack([a, a])

    def loss(x, ws):
      def layer(h_, w):
        y, st = mosaic.mosaic_ffn(ffn_mgpu, h_, *w, interpret=False, ell_width=128,
                                  tail_rows=None)
        return h_ + y, st.l1
      out, l1 = jax.lax.scan(jax.checkpoint(layer), x, ws)
      return jnp.sum(out.astype(F32)) + jnp.sum(l1)

    common.lower_for_cuda(jax.grad(loss, argnums=(0, 1)), x,
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
  )
  def test_grads_match_reference(self, m, d, h, gen, kw, gated=True):
    x, wg, wu, wd = ffn_inputs(jax.random.key(int(time.time_ns() % 2**31)), m, d, h,
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
