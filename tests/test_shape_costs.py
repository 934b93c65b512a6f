"""The shape table of the kernels' speed and what chooses by it: `implementation=None`
(the registry) and the trainer's per-layer choice run dense where the kernels measured slower."""

import json
import os

import jax.numpy as jnp
from absl.testing import absltest

import train_test_util as tu
from train.models import implementations
from train.models import layer_choice
from train.models import transformer as model_lib
from twell_jax import registry
from twell_jax import shape_costs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _call(d, h, m=8192, interpret=False):
  return registry.Call(m=m, d=d, h=h, gated=True, dtype=jnp.dtype(jnp.bfloat16),
                       activation="relu", interpret=interpret, ell_width=128, tail_rows=None)


class ShapeTableTest(absltest.TestCase):

  def test_table_is_the_measured_results(self):
    with open(os.path.join(REPO, "benchmarks", "results", "h100", "matrix.json")) as f:
      rows = json.load(f)["shapes"]
    measured = {(r["d"], r["h"], r["m"]): (r["fwd_ratio"], r["fwd_bwd_ratio"]) for r in rows}
    self.assertEqual(measured, shape_costs.MEASURED)
    self.assertTrue(all(r["exact"] for r in rows))

  def test_losing_shapes_and_nearest_lookup(self):
    for (d, h, m), ratios in shape_costs.MEASURED.items():
      self.assertEqual(shape_costs.sparse_loses(d, h, m), max(ratios) >= 1.0)
    self.assertTrue(shape_costs.sparse_loses(768, 2816))           # the small config
    self.assertTrue(shape_costs.sparse_loses(640, 1792))           # below every measured D
    self.assertFalse(shape_costs.sparse_loses(2048, 5632, 16384))  # the paper shape
    self.assertFalse(shape_costs.sparse_loses(4096, 14336))        # above: nearest wins
    self.assertEqual(shape_costs.shape_factor(2048, 5632, 16384), 1.0)
    self.assertLess(shape_costs.shape_factor(1536, 8960), 1.0)
    with self.assertRaises(ValueError):
      shape_costs.kernel_ratio(768, 2816, mode="backward")


class AutoImplementationTest(absltest.TestCase):
  """`pick` as on a Hopper GPU: the kernels' `unsupported` answers None there."""

  def setUp(self):
    super().setUp()
    self.enter_context(absltest.mock.patch.object(registry.MosaicGpu, "unsupported",
                                                  lambda self, call: None))

  def test_dense_where_the_kernels_lose(self):
    self.assertEqual(registry.pick(_call(768, 2816)).name, "dense")
    self.assertEqual(registry.pick(_call(896, 4864)).name, "dense")   # forward + backward 1.06
    self.assertEqual(registry.pick(_call(2048, 5632)).name, "mosaic_gpu")
    self.assertEqual(registry.pick(_call(1536, 8960, m=3000)).name, "mosaic_gpu")
    # The interpreter checks the kernels at any shape.
    self.assertEqual(registry.pick(_call(64, 256, interpret=True)).name, "mosaic_gpu")


def _model(d_model, d_ff, **kw):
  return model_lib.ModelConfig(vocab_size=256, d_model=d_model, n_layers=2, n_heads=8,
                               n_kv_heads=8, d_ff=d_ff, **kw)


class LayerChoiceShapeTest(absltest.TestCase):
  """The decider (`train.models.implementations`) scales the per-layer cost model by the shape
  table and keeps every layer dense where the kernels lose."""

  def _training(self, mc, tokens, sparse="mosaic_gpu"):
    cfg = tu.micro_config(**{"layer_choice.sparse": sparse})
    cfg.batch_size, cfg.grad_accum_steps, cfg.data.seq_len = tokens // 512, 1, 512
    return implementations.layer_choice(cfg, mc, n_devices=1)

  def test_no_layer_goes_sparse_where_the_kernels_lose(self):
    mc = _model(768, 2816)
    c = self._training(mc, 8192)
    self.assertTrue(c.shape_loses)
    c.update(c.predict([0, 512], [0.1, 1.0]))   # as sparse as a layer gets
    self.assertEqual(c.implementations, ("dense", "dense"))
    infer = implementations.inference_choice(mc, [0.5, 30.0], sparse="mosaic_gpu", tokens=8192)
    self.assertEqual(infer.implementations, ("dense", "dense"))

  def test_prediction_scales_with_the_shape(self):
    paper = self._training(_model(2048, 5632), 16384)
    wide = self._training(_model(1536, 8960), 16384)
    base = layer_choice.LayerChoice(1, 5632)
    self.assertEqual(float(paper.predict(0, 30.0)), float(base.predict(0, 30.0)))
    self.assertAlmostEqual(wide.shape_scale, 0.640 / 0.749, places=6)
    # Implementations without a measured table (xla) and the interpreter: unscaled.
    self.assertEqual(self._training(_model(768, 2816), 8192, sparse="xla").shape_scale, 1.0)
    interpreted = self._training(_model(768, 2816, interpret=True), 8192)
    self.assertEqual((interpreted.shape_scale, interpreted.shape_loses), (1.0, False))


if __name__ == "__main__":
  absltest.main()
