"""Tests of the Pallas Mosaic GPU TwELL kernels (pallas_kernels/).

* ``MgpuLoweringTest``: lowers the whole forward for CUDA on any host (the Mosaic GPU module
  is built in Python at lowering time, so layout/lowering errors surface without a GPU).
* ``MgpuKernelsInterpretTest``: runs the kernels under ``plgpu.InterpretGPUParams`` on the CPU
  (small shapes, CI), including one race-detection run.
* ``MgpuKernelsGpuTest``: the same cases compiled for a Hopper GPU; skipped elsewhere.
Every case compares with the f32 dense reference on fresh random inputs whose gate sparsity is
steered: x[:, 0] = 1 and w_gate[0, :] = -c puts the pre-activations at N(-c, ~1), so a chosen
mean number of features is active; heavy rows get x[:, 0] = 0 (about half their features fire).
"""

from __future__ import annotations

import time

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import norm

from pallas_kernels import common
from pallas_kernels import ffn_mgpu
from pallas_kernels import gate_pack_mgpu
from pallas_kernels import sparse_down_mgpu


def make_inputs(m, d, h, *, active=8.0, heavy=0.0, zero_rows=0, gated=True, seed=None):
  """bf16 (x, w_gate, w_up, w_down) with ~`active` gate features per row, `heavy` fraction of
  heavy rows (~50% active) and `zero_rows` all-zero rows at the end."""
  if seed is None:
    seed = int(time.time_ns() % (2**31))
  ks = jax.random.split(jax.random.key(seed), 4)
  c = float(norm.isf(min(active / h, 0.5)))
  x = jax.random.normal(ks[0], (m, d), jnp.float32).at[:, 0].set(1.0)
  n_heavy = int(round(heavy * m))
  if n_heavy:
    rows = np.random.default_rng(seed).choice(m, n_heavy, replace=False)
    x = x.at[rows, 0].set(0.0)
  if zero_rows:
    x = x.at[m - zero_rows:].set(0.0)
  wg = (jax.random.normal(ks[1], (d, h)) / np.sqrt(d - 1)).at[0].set(-c)
  wu = jax.random.normal(ks[2], (d, h)) / np.sqrt(d)
  wd = jax.random.normal(ks[3], (h, d)) / np.sqrt(h)
  b = lambda a: a.astype(jnp.bfloat16)
  if gated:
    return b(x), b(wg), b(wu), b(wd)
  return b(x), None, b(wg), b(wd)  # non-gated: the steered matrix is w_up


def check_forward(tc, x, wg, wu, wd, y, stats, *, capacity_exceeded=None):
  ref, h = ffn_mgpu.reference_forward(x, wg, wu, wd)
  y32 = np.asarray(y, np.float32)
  assert np.all(np.isfinite(y32))
  ref = np.asarray(ref)
  rel = np.linalg.norm(y32 - ref) / max(np.linalg.norm(ref), 1e-30)
  tc.assertLess(rel, 1.5e-2)
  np.testing.assert_allclose(y32, ref, atol=6e-2, rtol=6e-2)
  # Stats against the reference (gate activity from the f32 pre-activations).
  f = lambda a: a.astype(jnp.float32)
  pre = jnp.dot(f(x), f(wg if wg is not None else wu), precision=jax.lax.Precision.HIGHEST)
  act = np.asarray(pre > 0)
  hp = ffn_mgpu._round_up(act.shape[1], 256)
  act_p = np.pad(act, ((0, 0), (0, hp - act.shape[1])))
  tile_cnt = act_p.reshape(act.shape[0], -1, 256).sum(-1)
  np.testing.assert_allclose(float(stats["nnz_per_token"]), act.sum(1).mean(), rtol=1e-3)
  tc.assertEqual(int(stats["max_tile_nnz"]), int(tile_cnt.max()))
  tc.assertEqual(int(stats["overflow_rows"]), int((tile_cnt > 32).any(1).sum()))
  np.testing.assert_array_equal(np.asarray(stats["fired"]), act.any(0))
  np.testing.assert_allclose(float(stats["l1"]), float(np.abs(np.asarray(h)).sum(1).mean()),
                             rtol=2e-2)


class MgpuKernelsTestBase(parameterized.TestCase):
  INTERPRET = False

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and not common.on_hopper():
      self.skipTest("needs a Hopper GPU")

  def test_gate_pack_matches_dense_gate(self):
    x, wg, _, _ = make_inputs(256, 128, 512, active=12, heavy=0.02)
    words, counts = gate_pack_mgpu.gate_pack(x, wg, interpret=self.INTERPRET)
    g = np.asarray(jnp.dot(x, wg, preferred_element_type=jnp.float32))
    cnt = (g > 0).reshape(256, 2, 256).sum(-1)
    got_cnt = np.asarray(counts).reshape(256, 2, common.COUNT_LANES)
    np.testing.assert_array_equal(got_cnt, np.repeat(cnt[..., None], common.COUNT_LANES, -1))
    dense = np.asarray(gate_pack_mgpu.unpack_to_dense(words, counts, 512), np.float32)
    ok = (cnt <= 32).all(1)
    self.assertGreater(ok.sum(), 200)
    ref = np.maximum(g, 0)[ok]
    np.testing.assert_allclose(dense[ok], ref, rtol=1e-2, atol=1e-3)
    # Sorted, exact column sets: the decoded support equals the positive set.
    np.testing.assert_array_equal(dense[ok] > 0, ref > 0)

  @parameterized.parameters(dict(delay_release=1), dict(cluster_m=True),
                            dict(cluster_m=True, delay_release=1, grid_minor_dim=1),
                            dict(extract_ways=1),
                            dict(epilogue_wg=True, max_concurrent_steps=3),
                            dict(epilogue_wg=True, max_concurrent_steps=2, extract_ways=1),
                            dict(epilogue_wg=True, max_concurrent_steps=3, extract_ways=1,
                                 pack_chunk=128, packer_row_max="smem"))
  def test_gate_pack_configs_agree(self, **kw):
    """Pipelining depth, 2-CTA multicast clusters, the extraction loop's queue width and the
    packing warpgroup's chunk width / row-max method change the schedule, never the result."""
    x, wg, _, _ = make_inputs(512, 128, 512, active=12, heavy=0.02)
    base = gate_pack_mgpu.gate_pack(x, wg, interpret=self.INTERPRET)
    got = gate_pack_mgpu.gate_pack(x, wg, config=gate_pack_mgpu.GateConfig(**kw),
                                   interpret=self.INTERPRET)
    for a, b in zip(got, base):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_gate_config_rejects_unsupported_schedules(self):
    for kw in (dict(epilogue_wg=True), dict(epilogue_wg=True, max_concurrent_steps=3,
                                           cluster_m=True),
               dict(extract_ways=3), dict(tile_k=128), dict(pack_chunk=32),
               dict(packer_row_max="scan")):
      with self.assertRaises(ValueError):
        gate_pack_mgpu.GateConfig(**kw)

  @parameterized.named_parameters(
      dict(testcase_name="gated_aligned", m=256, d=128, h=512, active=8.0),
      dict(testcase_name="gated_odd_m_padded_dh_heavy", m=203, d=96, h=300, active=10.0,
           heavy=0.03, zero_rows=5),
      dict(testcase_name="nongated_heavy_fix_path", m=128, d=64, h=512, active=6.0,
           heavy=0.05, gated=False),
      dict(testcase_name="gated_capacity_exceeded_dense_fallback", m=130, d=128, h=256,
           active=4.0, heavy=0.6, capacity=64),
      dict(testcase_name="gated_thousands_active", m=128, d=64, h=2304, active=20.0,
           heavy=0.04),
      dict(testcase_name="gated_all_zero_x", m=64, d=64, h=256, zero_rows=64),
  )
  def test_forward_exact(self, m, d, h, active=8.0, heavy=0.0, zero_rows=0, gated=True,
                         capacity=None):
    x, wg, wu, wd = make_inputs(m, d, h, active=active, heavy=heavy, zero_rows=zero_rows,
                                gated=gated)
    y, stats = ffn_mgpu.ffn_forward(x, wg, wu, wd, interpret=self.INTERPRET,
                                    overflow_capacity=capacity)
    self.assertEqual(y.shape, (m, d))
    self.assertEqual(y.dtype, jnp.bfloat16)
    check_forward(self, x, wg, wu, wd, y, stats)
    if capacity is not None:
      self.assertGreater(int(stats["overflow_rows"]), capacity)
    if heavy >= 0.03:
      self.assertGreater(int(stats["overflow_rows"]), 0)

  @parameterized.parameters(True, False)
  def test_sparse_down_versions_agree(self, gated):
    """The prefetching fused kernel gives v1's bits (group 1: same summation order), and so do
    its x placements and the split (sampled-up + down) pair; v1 with group 2 (another order)
    gives the same values up to f32 rounding."""
    x, wg, wu, wd = make_inputs(128, 128, 768, active=10.0, heavy=0.05, zero_rows=3,
                                gated=gated)
    words, counts = gate_pack_mgpu.gate_pack(x, wg if gated else wu, interpret=self.INTERPRET)
    row_ok = (counts.reshape(128, 3, common.COUNT_LANES)[..., 0] <= 32).all(1).astype(jnp.int32)
    args = (x, words, counts, row_ok, wu.T if gated else None, wd)
    y, l1 = sparse_down_mgpu.sparse_down(*args, interpret=self.INTERPRET)
    variants = [dict(x_mode="bf16"), dict(x_mode="f32")]
    if gated:
      variants += [dict(split=True), dict(split=True, x_mode="reload")]
    for kw in variants:
      y2, l1_2 = sparse_down_mgpu.sparse_down(*args, interpret=self.INTERPRET, **kw)
      np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y2, np.float32),
                                    err_msg=str(kw))
      np.testing.assert_array_equal(np.asarray(l1), np.asarray(l1_2), err_msg=str(kw))
    for group in (1, 2):
      y1, l1_1 = sparse_down_mgpu.sparse_down(*args, prefetch=False, group=group,
                                              interpret=self.INTERPRET)
      if group == 1:
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y1, np.float32))
      else:
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y1, np.float32),
                                   rtol=1e-2, atol=1e-3)
      np.testing.assert_allclose(np.asarray(l1), np.asarray(l1_1), rtol=1e-5)

  def test_rejects_bad_input(self):
    x, wg, wu, wd = make_inputs(64, 64, 256)
    with self.assertRaisesRegex(ValueError, "w_down"):
      ffn_mgpu.ffn_forward(x, wg, wu, wd.T, interpret=self.INTERPRET)
    with self.assertRaisesRegex(ValueError, "bfloat16"):
      ffn_mgpu.ffn_forward(x.astype(jnp.float32), wg, wu, wd, interpret=self.INTERPRET)


class MgpuKernelsInterpretTest(MgpuKernelsTestBase):
  INTERPRET = True

  def test_no_races(self):
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu
    params = plgpu.InterpretGPUParams(detect_races=True)
    x, wg, wu, wd = make_inputs(128, 64, 256, active=8.0)
    words, counts = gate_pack_mgpu.gate_pack(x, wg, interpret=params)
    jax.block_until_ready(words)
    self.assertFalse(gpu_callbacks.get_races().races_found)
    row_ok = jnp.ones((128,), jnp.int32)
    xp = jnp.pad(x, ((0, 0), (0, 64)))
    y, _ = sparse_down_mgpu.sparse_down(xp, words, counts, row_ok,
                                        jnp.pad(wu, ((0, 64), (0, 0))).T,
                                        jnp.pad(wd, ((0, 0), (0, 64))), interpret=params)
    jax.block_until_ready(y)
    self.assertFalse(gpu_callbacks.get_races().races_found)


  def test_no_races_gate_packer_warpgroup(self):
    """The hand-written pipeline of the library's gate schedule (epilogue_wg): two tiles per
    CTA and more K steps than SMEM stages, so the refills, the cross-tile loads and the
    hand-over buffer's reuse all run under the race detector."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu
    params = plgpu.InterpretGPUParams(detect_races=True)
    x, wg, _, _ = make_inputs(2048, 256, 512, active=8.0, heavy=0.02)
    cfg = gate_pack_mgpu.LIBRARY_CONFIG
    self.assertTrue(cfg.epilogue_wg)
    got = gate_pack_mgpu.gate_pack(x, wg, config=cfg, interpret=params)
    jax.block_until_ready(got)
    self.assertFalse(gpu_callbacks.get_races().races_found)
    base = gate_pack_mgpu.gate_pack(x, wg, interpret=True)
    for a, b in zip(got, base):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  @parameterized.parameters("random", "sequential")
  def test_l2_probe_reads_the_rows_it_counts(self, order):
    """The L2 ceiling probe (PERF.md) sums exactly the rows whose bytes it reports."""
    from pallas_kernels import l2_probe
    table = jax.random.normal(jax.random.key(time.time_ns() % 2**31), (96, 256)).astype(
        jnp.bfloat16)
    want = l2_probe.probe_reference(table, n_ctas=3, steps=5, unroll=2, order=order)
    got = l2_probe.probe(table, n_ctas=3, steps=5, unroll=2, order=order, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    # The TMA variant (rows into SMEM, two slots; 128-column copies: two per row).
    got = l2_probe.probe_tma(table, n_ctas=3, steps=5, unroll=2, order=order, chunk=128,
                             interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)

  def test_l2_probe_row_lengths_checked_up_front(self):
    """--row_elems takes row lengths the probe kernel and its table sizes can use, and
    refuses others before any kernel is built."""
    from absl import app
    from pallas_kernels import l2_probe
    self.assertEqual(l2_probe._parse_row_elems(["2048", "4096"]), [2048, 4096])  # pylint: disable=protected-access
    for bad in (["3000"], ["0"], ["2048", "four"], ["384"]):
      with self.assertRaisesRegex(app.UsageError, "--row_elems"):
        l2_probe._parse_row_elems(bad)  # pylint: disable=protected-access


class MgpuLoweringTest(parameterized.TestCase):
  """Builds the Mosaic GPU modules for CUDA on any host (no GPU needed)."""

  @parameterized.parameters(True, False)
  def test_lowers_for_cuda(self, gated):
    x, wg, wu, wd = make_inputs(256, 256, 512, gated=gated)
    common.lower_for_cuda(lambda *a: ffn_mgpu.ffn_forward(*a), x, wg, wu, wd)

  @parameterized.parameters(dict(split=True), dict(x_mode="bf16"), dict(x_mode="f32"),
                            dict(split=True, x_mode="reload"))
  def test_sparse_down_variants_lower(self, **kw):
    x, wg, wu, wd = make_inputs(256, 256, 512)
    common.lower_for_cuda(lambda *a: ffn_mgpu.ffn_forward(*a, **kw), x, wg, wu, wd)


@pytest.mark.gpu
class MgpuKernelsGpuTest(MgpuKernelsTestBase):
  INTERPRET = False

  @parameterized.parameters((4096, 0.0, 30.0), (4096, 0.01, 30.0), (2048, 0.0, 60.0))
  def test_paper_shape(self, m, heavy, active):
    x, wg, wu, wd = make_inputs(m, 2048, 5632, active=active, heavy=heavy)
    y, stats = ffn_mgpu.ffn_forward(x, wg, wu, wd)
    check_forward(self, x, wg, wu, wd, y, stats)


if __name__ == "__main__":
  absltest.main()
