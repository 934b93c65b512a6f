"""The dense FFN on a device-counted row list (pallas_kernels/dense_rows_mgpu.py) against
``reference.dense_ffn_hidden`` on the same rows: no row, one row, a partial last row block, every
row, rows listed out of order and repeated, non-gated, and a NaN weight spreading as in the
dense FFN."""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_test_util as ktu
from pallas_kernels import dense_rows_mgpu
from pallas_kernels import reference


def _rows(m, r, seed):
  return jax.random.permutation(jax.random.key(seed), jnp.arange(r, dtype=jnp.int32) % m)


class DenseRowsTestBase(ktu.KernelTestBase):

  @parameterized.named_parameters(
      dict(testcase_name="none", n=0),
      dict(testcase_name="one", n=1),
      dict(testcase_name="partial_block", n=77),
      dict(testcase_name="all", n=128),
      dict(testcase_name="nongated_partial", n=70, gated=False),
  )
  def test_matches_dense_ffn(self, n, gated=True):
    m, d, h, r = 96, 128, 256, 128
    x, wg, wu, wd = ktu.inputs(m, d, h, active=20.0, heavy=0.05, gated=gated, seed=n)
    rows = _rows(m, r, seed=n)          # 128 > m: some rows listed twice
    y, l1, counts = dense_rows_mgpu.dense_ffn_rows(x, rows, jnp.int32(n), wg, wu, wd,
                                                   interpret=self.INTERPRET)
    self.assertEqual((y.shape, l1.shape, counts.shape), ((r, d), (r,), (h,)))
    y_ref, h_ref, act = reference.dense_ffn_hidden(x[rows[:n]], wg, wu, wd)
    np.testing.assert_allclose(np.asarray(y[:n], np.float32), np.asarray(y_ref, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(l1[:n]),
                               np.abs(np.asarray(h_ref, np.float32)).sum(1), rtol=1e-2)
    # Gates within rounding of zero may fall either way under another summation order.
    np.testing.assert_allclose(np.asarray(counts), np.asarray(act).sum(0), atol=1)
    if n == 0:
      self.assertEqual(int(counts.sum()), 0)

  def test_nan_weight_spreads_like_dense(self):
    m, d, h = 64, 128, 256
    x, wg, wu, wd = ktu.inputs(m, d, h, active=10.0, seed=3)
    wd = wd.at[7, 5].set(jnp.nan)
    rows = jnp.arange(m, dtype=jnp.int32)
    y, _, _ = dense_rows_mgpu.dense_ffn_rows(x, rows, jnp.int32(m), wg, wu, wd,
                                             interpret=self.INTERPRET)
    y_ref = reference.dense_ffn_hidden(x, wg, wu, wd)[0]
    np.testing.assert_array_equal(np.isnan(np.asarray(y, np.float32)),
                                  np.isnan(np.asarray(y_ref, np.float32)))
    self.assertTrue(np.isnan(np.asarray(y, np.float32)[:, 5]).all())

  def test_rejects_bad_shapes(self):
    x, wg, wu, wd = ktu.inputs(64, 128, 256)
    with self.assertRaisesRegex(ValueError, "bad shapes"):
      dense_rows_mgpu.dense_ffn_rows(x, jnp.arange(60, dtype=jnp.int32), 1, wg, wu, wd,
                                     interpret=self.INTERPRET)
    with self.assertRaisesRegex(ValueError, "block_m"):
      dense_rows_mgpu.DenseRowsConfig(block_m=128)


class DenseRowsInterpretTest(DenseRowsTestBase):
  INTERPRET = True

  def test_no_races(self):
    x, wg, wu, wd = ktu.inputs(64, 128, 256, active=10.0, seed=6)
    ktu.assert_race_free(lambda ip: dense_rows_mgpu.dense_ffn_rows(
        x, _rows(64, 128, 6), jnp.int32(100), wg, wu, wd, interpret=ip))


class DenseRowsLoweringTest(parameterized.TestCase):
  """Builds the Mosaic GPU modules for CUDA on any host (no GPU needed)."""

  @parameterized.parameters(True, False)
  def test_lowers_for_cuda(self, gated):
    x, wg, wu, wd = ktu.inputs(256, 256, 512, gated=gated)
    ktu.lower_for_cuda(
        lambda *a: dense_rows_mgpu.dense_ffn_rows(x, jnp.arange(256, dtype=jnp.int32), *a),
        jnp.int32(5), wg, wu, wd)


@pytest.mark.gpu
class DenseRowsGpuTest(DenseRowsTestBase):
  INTERPRET = False


if __name__ == "__main__":
  absltest.main()
