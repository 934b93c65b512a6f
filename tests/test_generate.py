"""Tests for train.generate: the KV-cache decode against the full forward, sampling, EOS,
errors, and the command line on a trained checkpoint."""

import copy
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import train_test_util as tu
from train.inference import generator
from train.inference import loading
from train.models import implementations
from train.models import transformer as model_lib
from train import errors


def _random_model(scan_layers: bool, **model):
  cfg = tu.micro_config(**{"model.scan_layers": scan_layers, "data.seq_len": 96,
                           **{f"model.{k}": v for k, v in model.items()}})
  lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
  params = lm.init_params(jax.random.key(1))
  # Larger weights than the init's 0.02: the greedy choice then depends on the whole prefix.
  params = jax.tree.map(lambda a: a * 5 if a.ndim >= 2 else a, params)
  return cfg, lm, params


class GenerateTest(tu.FastCompile, absltest.TestCase):

  def test_greedy_decode_with_cache_matches_the_full_forward(self):
    prompts = [[2, 5, 9, 100], [2, 7], [2, 50, 51, 52, 53, 54, 55, 56, 57]]
    for scan in (False, True):
      cfg, lm, params = _random_model(scan)
      out = generator.Generator(params, cfg).generate_ids(
          prompts, max_new_tokens=10, sampling=generator.Sampling(temperature=0.0),
          stop_at_eos=False)
      self.assertEqual(out.stats["decode_steps"], 9)
      self.assertEqual(out.stats["decode_ffn"], "DD")
      # The reference recomputes the whole prefix every step; one padded length (causal
      # attention: the padding after the prefix changes nothing) compiles once.
      fwd = jax.jit(lambda p, t: lm.apply(p, t)[0])
      for prompt, new in zip(prompts, out.tokens):
        seq = list(prompt)
        for _ in range(10):
          padded = jnp.asarray([seq + [0] * (32 - len(seq))])
          seq.append(int(jnp.argmax(fwd(params, padded)[0, len(seq) - 1])))
        self.assertEqual(new, seq[len(prompt):], f"scan_layers={scan}")
      # One prompt alone (decoded as two equal rows): its tokens in the batch.
      alone = generator.Generator(params, cfg).generate_ids(
          prompts[2:], max_new_tokens=10, sampling=generator.Sampling(temperature=0.0),
          stop_at_eos=False)
      self.assertEqual(alone.tokens, out.tokens[2:])
      self.assertEqual(alone.stats["decode_steps"], 9)
    # A sparse FFN implementation at prefill and decode (the portable one on the CPU) gives
    # the same tokens.
    sparse = generator.Generator(params, cfg, prefill_ffn="xla", decode_ffn="same")
    again = sparse.generate_ids(prompts, max_new_tokens=10, stop_at_eos=False,
                                sampling=generator.Sampling(temperature=0.0))
    self.assertEqual((again.stats["prefill_ffn"], again.stats["decode_ffn"]), ("SS", "SS"))
    self.assertEqual(again.tokens, out.tokens)
    # The few-row decode kernels (interpreted), which read only the firing features' W_up
    # and W_down rows: the same tokens too. Without the interpreter or a GPU, "auto" decodes
    # dense and "sparse" is refused.
    interpreted = copy.deepcopy(cfg)
    interpreted.model.interpret = True
    kernels = generator.Generator(params, interpreted, decode_ffn="sparse",
                                 decode_attention="kernel").generate_ids(
        prompts, max_new_tokens=10, stop_at_eos=False,
        sampling=generator.Sampling(temperature=0.0))
    self.assertEqual(kernels.stats["decode_ffn"], "SS")
    self.assertEqual(kernels.stats["decode_attention"], "kernel")   # interpreted too
    self.assertEqual(out.stats["decode_attention"], "xla")          # the CPU, compiled
    self.assertEqual(kernels.tokens, out.tokens)
    with self.assertRaisesRegex(errors.ConfigError, "decode_ffn='sparse': no GPU"):
      generator.Generator(params, cfg, decode_ffn="sparse").generate_ids(prompts)

  def test_recorded_gaps_are_the_top2_gaps_of_the_full_forward(self):
    """record_gaps: each new token's top-2 logit gap, as a full forward over its prefix gives
    it (up to rounding); the same tokens as without; None unless asked."""
    cfg, lm, params = _random_model(False)
    prompts = [[2, 5, 9, 100], [2, 7]]
    gen = generator.Generator(params, cfg)
    greedy = generator.Sampling(temperature=0.0)
    out = gen.generate_ids(prompts, max_new_tokens=6, sampling=greedy, stop_at_eos=False,
                           record_gaps=True)
    self.assertEqual(out.tokens, gen.generate_ids(prompts, max_new_tokens=6, sampling=greedy,
                                                  stop_at_eos=False).tokens)
    fwd = jax.jit(lambda p, t: lm.apply(p, t)[0])
    for prompt, new, gaps in zip(prompts, out.tokens, out.top2_gaps):
      self.assertLen(gaps, len(new))
      seq = prompt + new
      logits = fwd(params, jnp.asarray([seq + [0] * (16 - len(seq))]))[0].astype(jnp.float32)
      for i, gap in enumerate(gaps):
        top = jax.lax.top_k(logits[len(prompt) + i - 1], 2)[0]
        self.assertAlmostEqual(gap, float(top[0] - top[1]), delta=0.05)
    self.assertIsNone(gen.generate_ids(prompts, max_new_tokens=2).top2_gaps)

  def test_one_prompt_decodes_one_row_through_the_sparse_ffn(self):
    """A single prompt decodes as two equal rows (XLA keeps [2, D] projections GEMMs), but
    the decode FFN runs on one of them (its one-row kernel): the dense decode's tokens."""
    from unittest import mock  # pylint: disable=import-outside-toplevel
    from twell_jax import decode  # pylint: disable=import-outside-toplevel
    cfg, _, params = _random_model(False)
    prompt = [[2, 50, 51, 52, 53]]
    greedy = generator.Sampling(temperature=0.0)
    dense = generator.Generator(params, cfg).generate_ids(prompt, max_new_tokens=6,
                                                         sampling=greedy, stop_at_eos=False)
    interpreted = copy.deepcopy(cfg)
    interpreted.model.interpret = True
    rows = []
    real = decode.decode_ffn_weights

    def spy(x, *args, **kw):
      rows.append(x.shape[0])
      return real(x, *args, **kw)
    with mock.patch.object(decode, "decode_ffn_weights", spy):
      sparse = generator.Generator(params, interpreted, decode_ffn="sparse").generate_ids(
          prompt, max_new_tokens=6, sampling=greedy, stop_at_eos=False)
    self.assertEqual(sparse.stats["decode_ffn"], "SS")
    self.assertEqual(set(rows), {1})
    self.assertEqual(sparse.tokens, dense.tokens)

  def test_auto_decode_choice_follows_the_batch_union(self):
    """decode_ffn="auto": a layer decodes sparse while the features expected to fire in some
    row of the batch stay within DECODE_UNION_LIMIT of H; dense where the kernels cannot run."""
    cfg, _, params = _random_model(True, dtype="bfloat16")
    h = cfg.model.d_ff
    auto = generator.Generator(params, cfg)
    self.assertEqual(auto.plan.decode_implementations(1, None, [1.0, 1.0]), ("dense", "dense"))
    interpreted = copy.deepcopy(cfg)
    interpreted.model.interpret = True
    auto = generator.Generator(params, interpreted)
    self.assertEqual(auto.plan.decode_attention, "kernel")
    # Measured for 16-bit models only: an f32 model decodes dense with XLA's attention.
    interpreted.model.dtype = "float32"
    f32 = generator.Generator(params, interpreted)
    self.assertEqual(f32.plan.decode_implementations(1, None, [1.0, 1.0]), ("dense", "dense"))
    self.assertEqual(f32.plan.decode_attention, "xla")
    few, many = 0.02 * h, 0.6 * h
    self.assertEqual(auto.plan.decode_implementations(1, None, [few, many]), ("decode", "dense"))
    # 0.02 H per row: the union of 16 rows is ~28% of H, of 32 rows ~48%.
    self.assertEqual(auto.plan.decode_implementations(16, None, [few, few]), ("decode", "decode"))
    self.assertEqual(auto.plan.decode_implementations(32, None, [0.001 * h] * 2), ("dense", "dense"))
    self.assertEqual(implementations.DECODE_MAX_BATCH, 16)

  def test_sampling_filters(self):
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 512))
    key = jax.random.key(0)
    draw = lambda **kw: np.asarray(generator.sample(logits, key, generator.Sampling(**kw)))
    self.assertTrue(np.all(draw(temperature=0.0) == 0))
    self.assertTrue(np.all(draw(temperature=1.0, top_k=1) == 0))
    self.assertEqual(set(draw(temperature=1.0, top_k=2)), {0, 1})
    self.assertEqual(set(draw(temperature=1.0, top_p=0.7)), {0, 1})  # 0.5 < 0.7 <= 0.8
    self.assertEqual(set(draw(temperature=1.0)), {0, 1, 2, 3})
    np.testing.assert_array_equal(draw(temperature=1.0), draw(temperature=1.0))
    with self.assertRaisesRegex(errors.ConfigError, "top_p"):
      generator.Sampling(top_p=0.0)

  def test_stops_at_eos_and_pads_after_it(self):
    cfg, _, params = _random_model(False)
    # Every embedding row points the same way, EOS's furthest: the tied head always
    # prefers EOS once the blocks are zeroed.
    u = jax.random.normal(jax.random.key(2), (cfg.model.d_model,))
    scale = jnp.ones((cfg.model.vocab_size,)).at[2].set(3.0)
    params = {**params, "embed": scale[:, None] * u[None, :],
              "blocks": jax.tree.map(jnp.zeros_like, params["blocks"])}
    gen = generator.Generator(params, cfg)
    greedy = generator.Sampling(temperature=0.0)
    out = gen.generate_ids([[5, 6], [7]], max_new_tokens=6, sampling=greedy)
    self.assertEqual(out.tokens, [[], []])
    self.assertEqual(out.finished, [True, True])
    self.assertEqual(out.stats["decode_steps"], 0)
    out = gen.generate_ids([[5, 6]], max_new_tokens=6, sampling=greedy, stop_at_eos=False)
    self.assertEqual(out.stats["decode_steps"], 5)

  def test_prompt_longer_than_the_context_is_refused(self):
    cfg, _, params = _random_model(False)
    gen = generator.Generator(params, cfg)
    with self.assertRaisesRegex(errors.ConfigError, "exceeds the context of 96"):
      gen.generate_ids([[3] * 90], max_new_tokens=7)
    with self.assertRaisesRegex(errors.ConfigError, "decode_ffn"):
      generator.Generator(params, cfg, decode_ffn="gather")
    with self.assertRaisesRegex(errors.ConfigError, "decode_attention='flash'"):
      generator.Generator(params, cfg, decode_attention="flash")
    with self.assertRaisesRegex(errors.ConfigError, "decode_attention='kernel': no GPU"):
      generator.Generator(params, cfg, decode_attention="kernel")

  def test_text_api_and_cli_on_a_trained_checkpoint(self):
    wd = tu.trained_workdir("relu")
    ck = loading.load_checkpoint(wd)
    out = generator.generate(ck.params, ck.config, ["def ", "import"], max_new_tokens=12,
                            top_k=20, top_p=0.9, seed=3)
    self.assertLen(out.texts, 2)
    self.assertTrue(all(isinstance(t, str) for t in out.texts))
    self.assertGreater(out.stats["decode_tokens_per_s"], 0)
    self.assertEqual(out.stats["ffn_implementations"], ["dense"])  # the CPU: dense only
    again = generator.generate(ck.params, ck.config, ["def ", "import"], max_new_tokens=12,
                              top_k=20, top_p=0.9, seed=3)
    self.assertEqual(again.tokens, out.tokens)

    prompts = os.path.join(self.create_tempdir().full_path, "prompts.txt")
    with open(prompts, "w") as f:
      f.write("def add(a, b):\n\nclass Foo:\n")
    result = prompts + ".json"
    run = tu.run([sys.executable, "-m", "train.generate", f"--workdir={wd}",
                  f"--prompts_file={prompts}", "--num_samples=2", "--max_new_tokens=8",
                  "--temperature=0.7", "--top_k=40", f"--out={result}"],
                 JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    self.assertIn("tokens/s", run.stdout)
    self.assertIn("=== 3\nclass Foo:", run.stdout)
    with open(result) as f:
      saved = json.load(f)
    self.assertLen(saved["completions"], 4)
    self.assertEqual(saved["step"], 60)

  def test_cli_errors_are_one_line(self):
    wd = tu.trained_workdir("relu")
    for flags, message in (
        ([f"--workdir={self.create_tempdir().full_path}", "--prompt=x"],
         "error: no checkpoints"),
        ([f"--workdir={wd}", "--prompt=" + "x" * 20, "--max_new_tokens=16"],
         "plus max_new_tokens=16 exceeds the context of 32 tokens"),
        ([f"--workdir={wd}", "--prompt=" + "x" * 40],
         "a prompt of 41 tokens leaves no room in the context of 32 tokens")):
      run = tu.run([sys.executable, "-m", "train.generate", *flags],
                   JAX_DISABLE_MOST_OPTIMIZATIONS="1")
      self.assertNotEqual(run.returncode, 0)
      self.assertIn(message, run.stderr)
      self.assertNotIn("Traceback", run.stderr)


if __name__ == "__main__":
  absltest.main()
