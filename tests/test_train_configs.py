"""Every shipped config loads, validates and has the advertised size."""

import jax
from absl.testing import absltest
from absl.testing import parameterized

from configs import paper_0p5b, paper_1b, paper_1p5b, paper_2b, small, tiny
from train import model as model_lib
from train import train_lib


def _n_params(cfg) -> int:
  lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
  shapes = jax.eval_shape(lm.init_params, jax.random.key(0))
  return model_lib.count_params(shapes)


class ConfigsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("tiny", tiny.get_config(), 0.1e6, 0.2e6),
      ("small", small.get_config(), 90e6, 110e6),
      ("small_dense", small.get_config("dense"), 90e6, 110e6),
      ("paper_0p5b", paper_0p5b.get_config(), 0.45e9, 0.55e9),
      ("paper_1b", paper_1b.get_config(), 0.95e9, 1.05e9),
      ("paper_1p5b", paper_1p5b.get_config(), 1.45e9, 1.55e9),
      ("paper_2b", paper_2b.get_config(), 1.95e9, 2.1e9),
  )
  def test_size(self, cfg, lo, hi):
    train_lib.check_config(cfg, n_devices=1, n_processes=1)
    n = _n_params(cfg)
    self.assertBetween(n, lo, hi)

  def test_paper_shapes(self):
    for mod, layers in ((paper_0p5b, 8), (paper_1b, 18), (paper_1p5b, 28),
                        (paper_2b, 38)):
      m = mod.get_config().model
      self.assertEqual((m.d_model, m.d_ff, m.n_heads, m.n_layers),
                       (2048, 5632, 32, layers))
      self.assertEqual(mod.get_config().data.seq_len, 2048)

  def test_large_paper_configs_split_their_state_over_fsdp(self):
    """On 8 devices each holds about 1/8 of the 1.5B / 2B params and AdamW moments."""
    from train import sharding  # pylint: disable=g-import-not-at-top
    for mod in (paper_1p5b, paper_2b):
      cfg = mod.get_config()
      self.assertEqual(sharding.mesh_shape(cfg.mesh, 8), {"data": 1, "fsdp": 8})
      lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
      shapes = jax.eval_shape(lm.init_params, jax.random.key(0))
      total = per_device = 0
      for path, p in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        stacked = path[0].key == "blocks"
        split = any(sharding.param_spec(p.shape, 8, stacked=stacked))
        total += p.size
        per_device += p.size // 8 if split else p.size
      self.assertLess(per_device, total / 7.9)

  def test_dense_variant_and_bad_variant(self):
    c = small.get_config("dense")
    self.assertEqual((c.model.ffn_implementation, c.model.ffn_activation,
                      c.l1_coeff), ("dense", "silu", 0.0))
    with self.assertRaisesRegex(ValueError, "variant"):
      small.get_config("sparse-ish")

  def test_check_config_rejects_bad_batches(self):
    c = tiny.get_config()
    c.grad_accum_steps = 3
    with self.assertRaisesRegex(ValueError, "grad_accum_steps"):
      train_lib.check_config(c, 1, 1)
    c.grad_accum_steps = 1
    with self.assertRaisesRegex(ValueError, "devices"):
      train_lib.check_config(c, 3, 1)


if __name__ == "__main__":
  absltest.main()
