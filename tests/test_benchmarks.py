"""The benchmarks' own pieces on the CPU: specs, the L2 probe kernel (interpreter), and one
pass of the kernel benchmark over the tiny spec in interpret mode (a smoke test of the code
path; timings there mean nothing)."""

from __future__ import annotations

from absl import app
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels
from benchmarks import scaling
from benchmarks import specs
from benchmarks.probes import l2_rows


class SpecsTest(absltest.TestCase):

  def test_inputs_are_deterministic(self):
    a = specs.get("tiny").inputs(seed=3)
    b = specs.get("tiny").inputs(seed=3)
    for u, v in zip(a, b):
      np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))

  def test_unknown_spec(self):
    with self.assertRaisesRegex(KeyError, "unknown spec"):
      specs.get("paper_16x")


class L2ProbeTest(parameterized.TestCase):

  @parameterized.parameters("random", "sequential")
  def test_reads_the_rows_it_counts(self, order):
    """The L2 ceiling probe sums exactly the rows whose bytes it reports."""
    table = jax.random.normal(jax.random.key(5), (96, 256)).astype(jnp.bfloat16)
    want = l2_rows.probe_reference(table, n_ctas=3, steps=5, unroll=2, order=order)
    got = l2_rows.probe(table, n_ctas=3, steps=5, unroll=2, order=order, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    # The TMA variant (rows into SMEM, two slots; 128-column copies: two per row).
    got = l2_rows.probe_tma(table, n_ctas=3, steps=5, unroll=2, order=order, chunk=128,
                            interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)

  def test_row_lengths_checked_up_front(self):
    self.assertEqual(l2_rows._parse_row_elems(["2048", "4096"]), [2048, 4096])  # pylint: disable=protected-access
    for bad in (["3000"], ["0"], ["2048", "four"], ["384"]):
      with self.assertRaisesRegex(app.UsageError, "--row_elems"):
        l2_rows._parse_row_elems(bad)  # pylint: disable=protected-access


class KernelBenchmarkSmokeTest(absltest.TestCase):
  """The forward + backward benchmark's code path on the CPU, with the portable sparse
  implementation (the kernels' own interpret-mode tests cover mosaic_gpu)."""

  def test_forward_and_backward_on_the_tiny_spec(self):
    spec = specs.get("tiny")
    bwd = kernels.bench_fwd_bwd(spec, iters=1, impls=("dense", "xla"), interpret=False,
                                breakdown=False)
    self.assertNotIn("xla_error", bwd)
    self.assertLess(bwd["xla_residual_ratio"], 1.0)
    self.assertLess(max(bwd["xla_grad_rel_vs_dense"]), 5e-2)
    self.assertGreater(bwd["input"]["active_per_token"], 1.0)


class ScalingSmokeTest(absltest.TestCase):
  """The scaling benchmark's code path on one CPU device (the 4-device meshes are covered by
  tests/test_sharding.py)."""

  def test_one_mesh(self):
    import types  # pylint: disable=import-outside-toplevel
    fl = types.SimpleNamespace(shape="tiny", layers=2, batch_per_device=2, iters=1,
                               weights="init", remat=False, sparse="xla")
    r = scaling.run_mesh(fl, "sparse", 1, 1, scaling._params(fl))  # pylint: disable=protected-access
    self.assertEqual(r["mesh"], "1x1")
    self.assertGreater(r["tokens_per_s"], 0)
    self.assertEqual(r["collectives"], {})
    self.assertEqual(r["non_weight_collectives"], [])


if __name__ == "__main__":
  absltest.main()
