"""Tests for the Llama-style LM in train/models/transformer.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import train_test_util as tu
from train.models import implementations
from train.models import transformer as model_lib

def _cfg(**kw):
  base = dict(vocab_size=67, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              d_ff=256, dtype="float32")
  base.update(kw)
  return model_lib.ModelConfig(**base)


class ModelTest(tu.FastCompile, parameterized.TestCase):

  def test_shapes_params_and_stats(self):
    cfg = _cfg()
    lm = model_lib.LanguageModel(cfg)
    params = lm.init_params(jax.random.key(0))
    # Tied embeddings, no biases: embed + final norm + per layer
    # (q, k, v, o, 2 norms, gate/up/down).
    d, h, e = cfg.d_model, cfg.d_ff, cfg.head_dim
    per_layer = (d * d * 2 + 2 * d * cfg.n_kv_heads * e + 2 * d + 3 * d * h)
    self.assertEqual(model_lib.count_params(params),
                     cfg.vocab_size * d + d + cfg.n_layers * per_layer)
    self.assertNotIn("bias", str(jax.tree_util.tree_structure(params)))
    tokens = jnp.arange(2 * 12, dtype=jnp.int32).reshape(2, 12) % 67
    logits, stats = jax.jit(lm.apply)(params, tokens)
    self.assertEqual(logits.shape, (2, 12, cfg.vocab_size))
    self.assertEqual(logits.dtype, jnp.float32)
    self.assertEqual(stats.l1.shape, (cfg.n_layers,))
    self.assertEqual(stats.fired.shape, (cfg.n_layers, cfg.d_ff))
    # A random ReLU gate fires for about half the features.
    frac = np.asarray(stats.nnz_per_token) / cfg.d_ff
    self.assertTrue(np.all((frac > 0.3) & (frac < 0.7)), frac)

  @parameterized.parameters(1, 2, 4)
  def test_causal(self, kv_heads):
    lm = model_lib.LanguageModel(_cfg(n_kv_heads=kv_heads))
    params = lm.init_params(jax.random.key(1))
    t = jax.random.randint(jax.random.key(2), (1, 10), 0, 67)
    t2 = t.at[0, 6].set((t[0, 6] + 1) % 67)
    apply = jax.jit(lm.apply)
    a, _ = apply(params, t)
    b, _ = apply(params, t2)
    np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-5)
    self.assertGreater(float(jnp.max(jnp.abs(a[:, 6:] - b[:, 6:]))), 1e-4)

  def test_rope_is_relative(self):
    # <rope(q, i), rope(k, j)> depends on i - j only.
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    t = 9
    qs = model_lib.rope(jnp.broadcast_to(q, (1, t, 1, 8)), 10000.0)
    ks = model_lib.rope(jnp.broadcast_to(k, (1, t, 1, 8)), 10000.0)
    dot = lambda i, j: float(jnp.sum(qs[0, i, 0] * ks[0, j, 0]))
    self.assertAlmostEqual(dot(5, 2), dot(7, 4), places=4)
    self.assertNotAlmostEqual(dot(5, 2), dot(5, 4), places=3)

  def test_remat_matches_plain(self):
    tokens = jnp.ones((2, 8), jnp.int32)
    outs = []
    for remat in (False, True):
      lm = model_lib.LanguageModel(_cfg(remat=remat, n_layers=1))
      params = lm.init_params(jax.random.key(3))
      loss = lambda p, lm=lm: (lm.apply(p, tokens)[0] ** 2).mean()
      outs.append(jax.jit(jax.grad(loss))(params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                         atol=1e-7), *outs)

  @parameterized.parameters(False, True)
  def test_scan_layout_matches_loop_layout(self, remat):
    loop = model_lib.LanguageModel(_cfg(n_layers=3))
    scan = model_lib.LanguageModel(_cfg(n_layers=3, scan_layers=True,
                                        remat=remat))
    p_loop = loop.init_params(jax.random.key(4))
    p_scan = {k: v for k, v in p_loop.items() if k != "blocks"}
    p_scan["blocks"] = jax.tree.map(lambda *a: jnp.stack(a),
                                    *[p_loop["blocks"][l] for l in range(3)])
    self.assertEqual(jax.tree.structure(p_scan),
                     jax.tree.structure(scan.init_params(jax.random.key(0))))
    tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, 67)
    (la, sa), (lb, sb) = (jax.jit(loop.apply)(p_loop, tokens),
                          jax.jit(scan.apply)(p_scan, tokens))
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sa.fired, sb.fired)
    np.testing.assert_allclose(sa.l1, sb.l1, rtol=1e-5)
    # stacked_ffn gives the same [L, D, H] view of both layouts.
    jax.tree.map(np.testing.assert_array_equal,
                 model_lib.stacked_ffn(p_loop, 3),
                 model_lib.stacked_ffn(p_scan, 3))
    # The scan unrolled: the same parameters, logits and gradients.
    unrolled = model_lib.LanguageModel(_cfg(n_layers=3, scan_layers=True, remat=remat,
                                            scan_unroll=True))
    lc, _ = jax.jit(unrolled.apply)(p_scan, tokens)
    np.testing.assert_allclose(lc, lb, rtol=1e-5, atol=1e-5)
    grad = lambda lm: jax.jit(jax.grad(lambda p: (lm.apply(p, tokens)[0] ** 2).mean()))(p_scan)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 grad(scan), grad(unrolled))

  @parameterized.parameters(("dense", "silu"), ("dense", "relu"))
  def test_dense_baseline(self, implementation, activation):
    lm = model_lib.LanguageModel(_cfg(ffn_implementation=implementation,
                                      ffn_activation=activation))
    params = lm.init_params(jax.random.key(0))
    logits, stats = lm.apply(params, jnp.ones((1, 4), jnp.int32))
    self.assertTrue(bool(jnp.all(jnp.isfinite(logits))))
    if activation == "silu":  # SiLU is never exactly 0: nothing is sparse.
      np.testing.assert_allclose(stats.nnz_per_token, 256.0)

  def test_config_validation(self):
    with self.assertRaisesRegex(ValueError, "n_kv_heads"):
      _cfg(n_kv_heads=3)
    with self.assertRaisesRegex(ValueError, "dtype"):
      _cfg(dtype="float8")


class AttentionChoiceTest(absltest.TestCase):
  """Which attention kernel "auto" picks under XLA's deterministic ops."""

  def _pick(self, xla_flags: str, **kw):
    cfg = _cfg(dtype="bfloat16", **kw)
    with absltest.mock.patch.dict("os.environ", {"XLA_FLAGS": xla_flags}), \
         absltest.mock.patch.object(implementations.jax, "default_backend", lambda: "gpu"):
      return implementations.attention(cfg)

  def test_deterministic_ops_take_xla_attention_in_the_loop_layout(self):
    det = "--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true"
    self.assertEqual(self._pick(""), "cudnn")
    self.assertEqual(self._pick(det), "xla")
    self.assertEqual(self._pick("--xla_gpu_deterministic_ops"), "xla")
    self.assertEqual(self._pick("--xla_gpu_deterministic_ops=false"), "cudnn")
    self.assertEqual(self._pick(det, scan_layers=True), "cudnn")   # one call per program
    self.assertEqual(self._pick(det, scan_layers=True, scan_unroll=True), "xla")
    # Per-layer FFNs: a scan body per group of layers (the per-layer choice's steps).
    per_layer = dict(scan_layers=True, ffn_layer_implementations=("dense",) * 2)
    self.assertEqual(self._pick(det, **per_layer), "xla")
    self.assertEqual(self._pick("", **per_layer), "cudnn")
    self.assertEqual(self._pick(det, attention="cudnn"), "cudnn")  # asked for by name


class DeterministicTrainingGpuTest(absltest.TestCase):
  """The failure behind the fix above, on a GPU: the loop layout's train step under
  `--xla_gpu_deterministic_ops` (how kill / resume is compared bit for bit)."""

  @pytest.mark.gpu
  def test_loop_layout_trains_under_deterministic_ops(self):
    from pallas_kernels import _target as target  # pylint: disable=import-outside-toplevel
    if not target.on_hopper():
      self.skipTest("needs a Hopper GPU")
    wd = self.create_tempdir().full_path
    out = tu.run(tu.main_cmd(wd, "--config.model.dtype=bfloat16", "--config.num_train_steps=2",
                             "--config.eval_every=0", "--config.checkpoint_every=0"),
                 timeout=600, JAX_PLATFORMS="",
                 XLA_FLAGS="--xla_gpu_deterministic_ops=true")
    self.assertEqual(out.returncode, 0, out.stderr[-2000:])


if __name__ == "__main__":
  absltest.main()
