"""Every shipped config loads, validates and has the advertised size; bad settings are
refused before any work, with one error naming the field."""

import math
import os
import sys

import jax
from absl.testing import absltest
from absl.testing import parameterized

from configs import paper_0p5b, paper_1b, paper_1p5b, paper_2b, small, tiny
from train.models import transformer as model_lib
from train.config import checks as config_checks
from train import errors
from train.runtime import compilation
import train_test_util as tu


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
    if cfg.data.tokenizer == "sentencepiece":  # the paper configs name it on the command line
      with self.assertRaisesRegex(errors.ConfigError, "config.data.spm_model=None"):
        config_checks.check(cfg, n_devices=1, n_processes=1)
      cfg.data.spm_model = __file__   # any existing file passes the check
    config_checks.check(cfg, n_devices=1, n_processes=1)
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
    from train.runtime import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    for mod in (paper_1p5b, paper_2b):
      cfg = mod.get_config()
      self.assertEqual(mesh_lib.mesh_shape(cfg.mesh, 8), {"data": 1, "fsdp": 8})
      lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
      shapes = jax.eval_shape(lm.init_params, jax.random.key(0))
      total = per_device = 0
      for path, p in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        stacked = path[0].key == "blocks"
        split = any(mesh_lib.param_spec(p.shape, 8, stacked=stacked))
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
      config_checks.check(c, 1, 1)
    c.grad_accum_steps = 1
    with self.assertRaisesRegex(ValueError, "devices"):
      config_checks.check(c, 3, 1)


def _with(**overrides):
  c = tiny.get_config()
  for path, value in overrides.items():
    *parents, leaf = path.split("__")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


class ConfigChangeTest(absltest.TestCase):

  def test_unrolling_the_scan_is_free_changing_the_layout_is_refused(self):
    """The unrolled scan keeps the stacked checkpoints: a free change on resume; the layer
    layout itself is not."""
    from train.config import workdir as workdir_config  # pylint: disable=import-outside-toplevel
    stored = {"model": {"scan_layers": True, "scan_unroll": False}}
    kinds = workdir_config.changes(stored, {"model": {"scan_layers": True, "scan_unroll": True}})
    self.assertEqual(kinds["free"], [("model.scan_unroll", False, True)])
    kinds = workdir_config.changes(stored, {"model": {"scan_layers": False, "scan_unroll": False}})
    self.assertEqual(kinds["refused"], [("model.scan_layers", True, False)])

  def test_a_new_l1_weighting_on_resume_needs_the_flag(self):
    """The per-layer L1 scales, like the coefficient, fit the checkpoints but change the rest
    of the run: accepted with --accept_config_change, not silently."""
    from train.config import workdir as workdir_config  # pylint: disable=import-outside-toplevel
    kinds = workdir_config.changes({"l1_layer_scales": ""}, {"l1_layer_scales": "1,0.5"})
    self.assertEqual(kinds["acceptable"], [("l1_layer_scales", "", "1,0.5")])


class ConfigCheckTest(parameterized.TestCase):
  """`check_config` (train/config_checks.py) names the field, the value and the range."""

  @parameterized.named_parameters(
      ("negative_steps", dict(num_train_steps=-5), r"config\.num_train_steps=-5: must be an "
       r"integer >= 1"),
      ("zero_batch", dict(batch_size=0), r"config\.batch_size=0: must be an integer >= 1"),
      ("nan_learning_rate", dict(learning_rate=math.nan),
       r"config\.learning_rate=nan: must be a finite number >= 0"),
      ("negative_learning_rate", dict(learning_rate=-1e-3), r"config\.learning_rate=-0\.001"),
      ("min_lr_ratio", dict(min_lr_ratio=1.5), r"config\.min_lr_ratio=1\.5: .*>= 0 and <= 1"),
      ("adam_b2", dict(adam_b2=1.0), r"config\.adam_b2=1\.0: .*>= 0 and < 1"),
      ("grad_clip", dict(grad_clip=0.0), r"config\.grad_clip=0\.0: .* > 0"),
      ("l1_coeff", dict(l1_coeff=-2e-5), r"config\.l1_coeff=-2e-05"),
      ("infinite_l1", dict(l1_coeff=math.inf), r"config\.l1_coeff=inf: must be a finite"),
      ("seq_len", dict(data__seq_len=0), r"config\.data\.seq_len=0"),
      ("prefetch", dict(data__prefetch=0), r"config\.data\.prefetch=0"),
      ("d_model", dict(model__d_model=0), r"config\.model\.d_model=0"),
      ("rope_theta", dict(model__rope_theta=0.0), r"config\.model\.rope_theta=0\.0"),
      ("keep_checkpoints", dict(keep_checkpoints=0), r"config\.keep_checkpoints=0"),
      ("log_every", dict(log_every=0), r"config\.log_every=0"),
      ("profile_steps", dict(profile__steps=-1), r"config\.profile\.steps=-1"),
      ("dtype", dict(model__dtype="float8"), r"config\.model\.dtype='float8': must be one of"),
      ("l1_normalization", dict(l1_normalization="mean"), r"config\.l1_normalization='mean'"),
      ("implementation", dict(model__ffn_implementation="cuda"),
       r"config\.model\.ffn_implementation='cuda': must be one of"),
      ("gradient_reduction", dict(mesh__gradient_reduction="nccl"),
       r"config\.mesh\.gradient_reduction='nccl': must be one of"),
      ("layer_choice_bounds", dict(layer_choice__sparse_below=50.0,
                                   layer_choice__dense_above=10.0),
       r"config\.layer_choice\.dense_above=10\.0 must be >= "
       r"config\.layer_choice\.sparse_below=50\.0"),
      ("ahead_steps", dict(layer_choice__ahead="256,1000:last"),
       r"config\.layer_choice\.ahead='256,1000:last': '1000:last': K must be a positive "
       r"multiple of 256"),
      ("ahead_syntax", dict(layer_choice__ahead="256;1024"),
       r"config\.layer_choice\.ahead='256;1024': '256;1024' is not K or K:last"),
      ("heads", dict(model__n_heads=3), r"config\.model: .*divisible by self\.n_heads=3"),
      ("grad_accum", dict(grad_accum_steps=3), r"config\.batch_size=16 must be divisible by "
       r"config\.grad_accum_steps=3"),
      ("sentencepiece_model", dict(data__tokenizer="sentencepiece", data__spm_model="/no/such"),
       r"config\.data\.spm_model='/no/such'"),
      ("l1_layer_scales_count", dict(l1_layer_scales="1,1,1"),
       r"config\.l1_layer_scales='1,1,1': has 3 numbers for the model's 2 layers"),
      ("l1_layer_scales_negative", dict(l1_layer_scales="1,-0.5"),
       r"config\.l1_layer_scales='1,-0\.5': every number must be finite and >= 0"),
      ("l1_layer_scales_text", dict(l1_layer_scales="1;1"),
       r"config\.l1_layer_scales='1;1': must be numbers separated by commas"),
  )
  def test_bad_value_names_the_field(self, overrides, match):
    with self.assertRaisesRegex(errors.ConfigError, match):
      config_checks.check(_with(**overrides), n_devices=1, n_processes=1)

  def test_implementation_against_the_backend(self):
    if jax.default_backend() == "gpu":
      self.skipTest("a GPU is present")
    with self.assertRaisesRegex(errors.ConfigError,
                                r"config\.model\.ffn_implementation='mosaic_gpu' cannot run "
                                r"here: no GPU backend .*--config\.model\.interpret=True"):
      config_checks.check(_with(model__ffn_implementation="mosaic_gpu"), 1, 1)
    with self.assertRaisesRegex(errors.ConfigError,
                                r"config\.layer_choice\.sparse='mosaic_gpu' cannot run here"):
      config_checks.check(_with(layer_choice__sparse="mosaic_gpu"), 1, 1)
    # In the interpreter the kernels need bfloat16 (tiny computes in float32).
    with self.assertRaisesRegex(errors.ConfigError, r"x must be bfloat16, got float32"):
      config_checks.check(_with(model__ffn_implementation="mosaic_gpu",
                                   model__interpret=True), 1, 1)
    with self.assertRaisesRegex(errors.ConfigError, r"config\.model\.remat=True: JAX "
                                r"refuses jax\.checkpoint"):
      config_checks.check(_with(model__ffn_implementation="mosaic_gpu",
                                   model__interpret=True, model__dtype="bfloat16",
                                   model__remat=True), 1, 1)
    config_checks.check(_with(model__ffn_implementation="mosaic_gpu", model__interpret=True,
                                 model__dtype="bfloat16"), 1, 1)
    with self.assertRaisesRegex(errors.ConfigError, r"config\.model\.attention='cudnn' "
                                r"needs a GPU"):
      config_checks.check(_with(model__attention="cudnn"), 1, 1)


class CommandLineTest(absltest.TestCase):
  """Through `python -m train.main`: refused before any data or compile work; the kernels
  in the interpreter from the command line."""

  def test_bad_settings_fail_up_front(self):
    wd = self.create_tempdir().full_path
    for flag, message in (
        ("--config.num_train_steps=-5", "error: config.num_train_steps=-5: must be an integer"),
        ("--config.batch_size=0", "error: config.batch_size=0: must be an integer >= 1"),
        ("--config.learning_rate=nan", "error: config.learning_rate=nan: must be a finite"),
        ("--config.model.ffn_implementation=mosaic_gpu",
         "error: config.model.ffn_implementation='mosaic_gpu' cannot run here")):
      if "mosaic_gpu" in flag and jax.default_backend() == "gpu":
        continue
      out = tu.run(tu.main_cmd(wd, flag))
      self.assertEqual(out.returncode, 1, out.stderr[-3000:])
      self.assertIn(message, out.stderr)
      self.assertNotIn("Traceback", out.stderr)
      self.assertNotIn("Reusing dataset", out.stderr)   # no data pipeline was built
      self.assertNotIn("Parameters:", out.stderr)       # nor any state
      self.assertFalse(os.path.exists(os.path.join(wd, "checkpoints")))

  def test_a_command_that_succeeds_leaves_without_the_teardown(self):
    # Output still buffered is flushed; the interpreter's exit handlers (JAX's teardown among
    # them) do not run.
    code = ("import atexit, sys\n"
            "from train import cli\n"
            "atexit.register(lambda: print('teardown ran', flush=True))\n"
            "sys.argv = ['cmd']\n"
            "cli.run(lambda: print('done', end=''))\n")
    out = tu.run([sys.executable, "-c", code])
    self.assertEqual((out.returncode, out.stdout), (0, "done"), out.stderr[-3000:])


class CompilationCacheTest(absltest.TestCase):
  """`compilation.use_compilation_cache`: on for GPU runs at the config's directory, never over
  a directory the user set, off on the CPU."""

  def test_where_the_cache_goes(self):
    before = jax.config.jax_compilation_cache_dir
    tmp = self.create_tempdir().full_path
    try:
      jax.config.update("jax_compilation_cache_dir", None)
      self.assertIsNone(compilation.use_compilation_cache(tmp + "/c", backend="cpu"))
      self.assertIsNone(compilation.use_compilation_cache("", backend="gpu"))
      self.assertEqual(compilation.use_compilation_cache(tmp + "/c", backend="gpu"), tmp + "/c")
      self.assertEqual(jax.config.jax_compilation_cache_dir, tmp + "/c")
      # Set already (--jax_compilation_cache_dir): kept.
      self.assertEqual(compilation.use_compilation_cache(tmp + "/d", backend="gpu"), tmp + "/c")
    finally:
      jax.config.update("jax_compilation_cache_dir", before)


class BesideTrainingTest(absltest.TestCase):
  """`compilation.beside_training`: the switch interval short and the collector off while any
  compile on a worker thread is inside, both back as they were when the last one leaves."""

  def test_settings_held_until_the_last_compile_leaves(self):
    import gc  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel
    interval, collecting = sys.getswitchinterval(), gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def other_compile():
      with compilation.beside_training():
        inside.set()
        leave.wait(10)

    worker = threading.Thread(target=other_compile)
    worker.start()
    try:
      self.assertTrue(inside.wait(10))
      with compilation.beside_training():
        self.assertLess(sys.getswitchinterval(), 1e-3)
        self.assertFalse(gc.isenabled())
      # The other compile is still inside: unchanged by this one's leaving.
      self.assertLess(sys.getswitchinterval(), 1e-3)
      self.assertFalse(gc.isenabled())
    finally:
      leave.set()
      worker.join(10)
    self.assertEqual(sys.getswitchinterval(), interval)
    self.assertEqual(gc.isenabled(), collecting)


if __name__ == "__main__":
  absltest.main()
