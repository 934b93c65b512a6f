"""The inference forward (pallas_kernels/ffn_mgpu.py), its TwELL -> ELL conversion and its
fused up / down kernel (pallas_kernels/ell_up_down_mgpu.py) against the f32 reference.

Inputs from `twell_jax.testing.ffn_inputs` with fixed seeds: uniform and skewed activity (a
feature firing on most rows, most features dead, near-dense rows), heavy rows over the TwELL
tile capacity, all-zero rows, odd shapes, most rows overflowing.
"""

from __future__ import annotations

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_test_util as ktu
from pallas_kernels import _common as common
from pallas_kernels import _row_loops as row_loops
from pallas_kernels import ell_up_down_mgpu
from pallas_kernels import ffn_mgpu
from pallas_kernels import gate_pack_mgpu
from pallas_kernels import reference


def check_forward(tc, x, wg, wu, wd, y, stats):
  ref, h = reference.reference_ffn_hidden(x, wg, wu, wd)
  y32 = np.asarray(y, np.float32)
  ref = np.asarray(ref)
  tc.assertLess(ktu.rel(y32, ref), 1.5e-2)
  # Element-wise, with an absolute tolerance that grows with the row's magnitude (heavy rows
  # reach |y| ~ 1e3, where one bf16 ulp of an h term is larger than any fixed tolerance).
  row_scale = np.maximum(1.0, np.abs(ref).max(axis=1, keepdims=True))
  bad = np.abs(y32 - ref) > 6e-2 * np.abs(ref) + 2e-2 * row_scale
  tc.assertFalse(bad.any(), f"{bad.sum()} elements off, first at {np.argwhere(bad)[:3]}")
  # Stats against the reference (gate activity from the f32 pre-activations).
  f = lambda a: a.astype(jnp.float32)
  pre = jnp.dot(f(x), f(wg if wg is not None else wu), precision=jax.lax.Precision.HIGHEST)
  act = np.asarray(pre > 0)
  hp = common.round_up(act.shape[1], 256)
  tile_cnt = np.pad(act, ((0, 0), (0, hp - act.shape[1]))).reshape(act.shape[0], -1, 256).sum(-1)
  np.testing.assert_allclose(float(stats["nnz_per_token"]), act.sum(1).mean(), rtol=1e-3)
  tc.assertEqual(int(stats["max_tile_nnz"]), int(tile_cnt.max()))
  over = (tile_cnt > 32).any(1) | (act.sum(1) > ffn_mgpu.ForwardConfig().max_row_entries)
  tc.assertEqual(int(stats["overflow_rows"]), int(over.sum()))
  # Gates within rounding of zero may fall on either side on the tensor cores: a token or
  # two per feature in thousands.
  np.testing.assert_allclose(np.asarray(stats["feature_counts"]), act.sum(0),
                             atol=1 + act.shape[0] // 1000)
  np.testing.assert_allclose(float(stats["l1"]), float(np.abs(np.asarray(h)).sum(1).mean()),
                             rtol=2e-2)


class ForwardTestBase(ktu.KernelTestBase):

  @parameterized.named_parameters(
      dict(testcase_name="gated_aligned", m=256, d=128, h=512, active=8.0),
      dict(testcase_name="gated_odd_m_padded_dh_heavy", m=203, d=96, h=300, active=10.0,
           heavy=0.03, empty=0.03),
      dict(testcase_name="nongated_heavy_fix_path", m=128, d=64, h=512, active=6.0,
           heavy=0.05, gated=False),
      dict(testcase_name="gated_most_rows_dense", m=130, d=128, h=256, active=4.0,
           heavy=0.6),
      dict(testcase_name="gated_thousands_active", m=128, d=64, h=2304, active=20.0,
           heavy=0.04),
      dict(testcase_name="gated_all_zero_x", m=64, d=64, h=256, empty=1.0),
      # Real L1-trained layers: a feature on 70% of the rows, 90% of the features dead,
      # heavy-tailed rows (some nearly all-active among the alive features).
      dict(testcase_name="gated_skewed", m=256, d=128, h=768, active=10.0, heavy=0.02,
           skew=dict(dead_fraction=0.9, hottest=0.7, row_spread=0.6)),
  )
  def test_forward_exact(self, m, d, h, active=8.0, heavy=0.0, empty=0.0, gated=True,
                         skew=None):
    x, wg, wu, wd = ktu.inputs(m, d, h, active=active, heavy=heavy, empty=empty, gated=gated,
                               seed=m + h, **(skew or {}))
    y, stats = ffn_mgpu.ffn_forward(x, wg, wu, wd, interpret=self.INTERPRET)
    self.assertEqual(y.shape, (m, d))
    self.assertEqual(y.dtype, jnp.bfloat16)
    check_forward(self, x, wg, wu, wd, y, stats)
    if heavy >= 0.5:
      self.assertGreater(int(stats["overflow_rows"]), m // 2)
    if heavy >= 0.03:
      self.assertGreater(int(stats["overflow_rows"]), 0)

  @parameterized.parameters(True, False)
  def test_hot_features_change_nothing_but_rounding(self, gated):
    """K = 0 (every entry through the fused kernel), 256 and all 768 features dense: same y,
    l1 and statistics, on skewed inputs with heavy rows (the overflow path joins in); the
    features are sorted by popularity first, as a caller would."""
    x, wg, wu, wd = ktu.inputs(128, 64, 768, active=12.0, heavy=0.03, gated=gated, seed=9,
                               dead_fraction=0.6, hottest=0.8, row_spread=0.4)
    counts = ffn_mgpu.ffn_forward(x, wg, wu, wd, interpret=self.INTERPRET)[1]["feature_counts"]
    order = jnp.argsort(-counts, stable=True)
    wg, wu, wd = (None if wg is None else wg[:, order]), wu[:, order], wd[order]
    run = lambda k: ffn_mgpu.ffn_forward(x, wg, wu, wd, interpret=self.INTERPRET,
                                         config=ffn_mgpu.ForwardConfig(hot_features=k))
    y0, st0 = run(0)
    check_forward(self, x, wg, wu, wd, y0, st0)
    for k in (256, 768):
      y, st = run(k)
      self.assertLess(ktu.rel(y, y0), 1e-2, k)
      np.testing.assert_allclose(float(st["l1"]), float(st0["l1"]), rtol=1e-3)
      for key in ("feature_counts", "max_tile_nnz", "nnz_per_token"):
        np.testing.assert_array_equal(np.asarray(st[key]), np.asarray(st0[key]), key)
      # Hot tiles never overflow: fewer rows take the dense fix-up.
      self.assertLessEqual(int(st["overflow_rows"]), int(st0["overflow_rows"]))

  @parameterized.parameters(True, False)
  def test_ell_kernel_choices_agree(self, gated):
    """Where x_r lives (f32 / bf16 registers, or reloaded), rows loaded ahead or not,
    entries side by side and the TwELL -> ELL conversion (kernel or XLA) never change a bit
    of y or the statistics (l1 to its last bits: XLA sums the rows); nor does an ELL width
    that is not a multiple of the group (the forward pads it)."""
    x, wg, wu, wd = ktu.inputs(128, 128, 768, active=10.0, heavy=0.05, empty=0.02,
                               gated=gated, seed=4)
    G = row_loops.GatherConfig
    run = lambda **kw: ffn_mgpu.ffn_forward(x, wg, wu, wd, interpret=self.INTERPRET,
                                            config=ffn_mgpu.ForwardConfig(**kw))
    base = run()
    # Several choices a run (each costs seconds in the interpreter); the non-gated forward
    # reads one row per entry where the gated one reads two: the row modes again.
    variants = [dict(ell=G(row_mode="bf16", group=3)),
                dict(ell=G(row_mode="reload", rows_ahead=True), convert="xla")]
    if gated:
      variants.append(dict(ell=G(group=2), max_row_entries=45))
    for kw in variants:
      got = run(**kw)
      if "max_row_entries" in kw:   # more rows take the dense fix-up: same values, rounding
        self.assertLess(ktu.rel(got[0], base[0]), 1e-2)
        continue
      np.testing.assert_array_equal(np.asarray(got[0], np.float32),
                                    np.asarray(base[0], np.float32), err_msg=str(kw))
      for key, value in got[1].items():
        if key == "l1":   # an XLA sum over the rows, whose order may follow the fusion
          np.testing.assert_allclose(float(value), float(base[1][key]), rtol=1e-6)
        else:
          np.testing.assert_array_equal(np.asarray(value), np.asarray(base[1][key]),
                                        err_msg=f"{kw} {key}")

  @parameterized.parameters(0, 256)
  def test_ell_from_twell_lists_each_rows_actives_in_column_order(self, col_start):
    """Every row that fits holds exactly its positive gates, in increasing column order, with
    their bf16 values; rows over the width or with an overflowing tile are flagged and empty."""
    m, d, h, width = 128, 64, 1024, 40
    x, wg, _, _ = ktu.inputs(m, d, h, active=16.0, heavy=0.05, seed=8)
    words, counts = gate_pack_mgpu.gate_pack(x, wg, col_start=col_start,
                                             interpret=self.INTERPRET)
    entries, n, over, cnt = jax.jit(functools.partial(
        ell_up_down_mgpu.ell_from_twell, slots=32, width=width))(words, counts)
    cols, p = ell_up_down_mgpu.split_entries(entries)
    g = np.asarray(jnp.dot(x, wg, preferred_element_type=jnp.float32))[:, col_start:]
    act = g > 0
    tiles = act.reshape(m, -1, 256).sum(-1)
    np.testing.assert_array_equal(np.asarray(cnt), tiles.T)
    want_over = (act.sum(1) > width) | (tiles > 32).any(1)
    np.testing.assert_array_equal(np.asarray(over), want_over)
    self.assertTrue(want_over.any() and not want_over.all())
    cols, p, n = np.asarray(cols), np.asarray(p, np.float32), np.asarray(n)
    for r in range(m):
      if want_over[r]:
        self.assertEqual(n[r], 0)
        continue
      (js,) = np.nonzero(act[r])
      self.assertEqual(n[r], len(js))
      np.testing.assert_array_equal(cols[r, :n[r]], js + col_start)
      np.testing.assert_array_equal(p[r, :n[r]],
                                    g[r, js].astype(jnp.bfloat16).astype(np.float32))
      self.assertTrue((cols[r, n[r]:] == 0).all() and (p[r, n[r]:] == 0).all())

  @parameterized.parameters(True, False)
  def test_weight_check_in_the_gate_kernel_agrees(self, gated):
    """The gate kernel's check of w_up (gated) and w_down gives the bits of the XLA check's
    forward: on finite weights (heavy and empty rows), and with an infinity in w_up or a NaN
    in w_down, which send every row down the dense path."""
    x, wg, wu, wd = ktu.inputs(256, 128, 512, active=10.0, heavy=0.05, empty=0.02,
                               gated=gated, seed=9)
    run = lambda *w, check: ffn_mgpu.ffn_forward(
        x, *w, interpret=self.INTERPRET, config=ffn_mgpu.ForwardConfig(weight_check=check))
    # Gated: finite weights and an infinity in w_up; not gated: a NaN in w_down (every
    # weight the kernel checks, finite and not, in one of the two).
    cases = ([(wg, wu, wd), (wg, wu.at[100, 511].set(jnp.inf), wd)] if gated else
             [(wg, wu, wd.at[300, 5].set(jnp.nan))])
    for i, w in enumerate(cases):
      got, want = run(*w, check="gate"), run(*w, check="xla")
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=f"case {i}")
      self.assertEqual(bool(np.isfinite(np.asarray(got[0], np.float32)).all()),
                       gated and i == 0)

  def test_auto_weight_check_goes_to_the_gate_kernel_where_a_tile_covers_two_blocks(self):
    """weight_check="auto" hands the check to the gate kernel exactly when every CTA has a
    tile for each one or two blocks of its share (8 SMs in the interpreter)."""
    per_tile = functools.partial(gate_pack_mgpu.check_blocks_per_tile, interpret=True)
    self.assertEqual(per_tile(128 * 512, 256, 2), 0)      # 4 tiles: some CTAs have none
    self.assertEqual(per_tile(128 * 512, 1024, 2), 1)     # 16 blocks, 16 tiles
    self.assertEqual(per_tile(512 * 512, 1024, 2), 4)     # 64 blocks, 16 tiles
    bf16, wants = jnp.bfloat16, {}
    real = gate_pack_mgpu.gate_pack

    def spy(*a, check=(), **kw):
      wants["check"] = len(check)
      return real(*a, check=check, **kw)

    for d, want in ((128, 2), (512, 0)):
      with mock.patch.object(gate_pack_mgpu, "gate_pack", spy):
        jax.make_jaxpr(functools.partial(ffn_mgpu.ffn_forward.__wrapped__, interpret=True))(
            jnp.zeros((1024, d), bf16), jnp.zeros((d, 512), bf16), jnp.zeros((d, 512), bf16),
            jnp.zeros((512, d), bf16))
      self.assertEqual(wants["check"], want, f"D={d}")

  def test_rejects_bad_input(self):
    x, wg, wu, wd = ktu.inputs(64, 64, 256)
    with self.assertRaisesRegex(ValueError, "w_down"):
      ffn_mgpu.ffn_forward(x, wg, wu, wd.T, interpret=self.INTERPRET)
    with self.assertRaisesRegex(ValueError, "bfloat16"):
      ffn_mgpu.ffn_forward(x.astype(jnp.float32), wg, wu, wd, interpret=self.INTERPRET)
    with self.assertRaisesRegex(ValueError, "max_row_entries"):
      ffn_mgpu.ForwardConfig(max_row_entries=0)
    for k in (-256, 100):
      with self.assertRaisesRegex(ValueError, "hot_features"):
        ffn_mgpu.ForwardConfig(hot_features=k)
    with self.assertRaisesRegex(ValueError, "row_mode"):
      row_loops.GatherConfig(row_mode="registers")
    with self.assertRaisesRegex(ValueError, "weight_check"):
      ffn_mgpu.ForwardConfig(weight_check="host")
    with self.assertRaisesRegex(ValueError, "convert"):
      ffn_mgpu.ForwardConfig(convert="cuda")


class ForwardInterpretTest(ForwardTestBase):
  INTERPRET = True

  def test_no_races(self):
    x, wg, wu, wd = ktu.inputs(128, 128, 256, active=8.0, seed=5)
    words, counts = gate_pack_mgpu.gate_pack(x, wg, interpret=True)
    entries, n, _, _ = ell_up_down_mgpu.ell_from_twell(words, counts, slots=32, width=64)
    ktu.assert_race_free(lambda ip: ell_up_down_mgpu.ell_up_down(
        x, entries, n, wu.T, wd, write_u=False,
        config=ffn_mgpu.ForwardConfig().ell, interpret=ip))


class ForwardLoweringTest(parameterized.TestCase):
  """Builds the Mosaic GPU modules for CUDA on any host (no GPU needed)."""

  @parameterized.product(gated=(True, False), row_mode=("reload", "f32", "bf16"))
  def test_lowers_for_cuda(self, gated, row_mode):
    x, wg, wu, wd = ktu.inputs(256, 256, 512, gated=gated)
    cfg = ffn_mgpu.ForwardConfig(ell=row_loops.GatherConfig(rows_ahead=True, row_mode=row_mode))
    ktu.lower_for_cuda(lambda *a: ffn_mgpu.ffn_forward(*a, config=cfg), x, wg, wu, wd)

  @parameterized.parameters(True, False)
  def test_lowers_for_cuda_with_the_gate_kernels_weight_check(self, gated):
    x, wg, wu, wd = ktu.inputs(256, 256, 512, gated=gated)
    cfg = ffn_mgpu.ForwardConfig(weight_check="gate")
    ktu.lower_for_cuda(lambda *a: ffn_mgpu.ffn_forward(*a, config=cfg), x, wg, wu, wd)


@pytest.mark.gpu
class ForwardGpuTest(ForwardTestBase):
  INTERPRET = False

  @parameterized.parameters(
      (4096, 0.0, 30.0, {}), (4096, 0.01, 30.0, {}), (2048, 0.0, 60.0, {}),
      (4096, 0.01, 30.0, dict(dead_fraction=0.9, hottest=0.7, row_spread=0.6)))
  def test_paper_shape(self, m, heavy, active, skew):
    x, wg, wu, wd = ktu.inputs(m, 2048, 5632, active=active, heavy=heavy, seed=6, **skew)
    y, stats = ffn_mgpu.ffn_forward(x, wg, wu, wd)
    check_forward(self, x, wg, wu, wd, y, stats)


if __name__ == "__main__":
  absltest.main()
