"""Helpers shared by the training-system tests (not a test module)."""

import os
import subprocess
import sys
import tempfile

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def offline_data_dir() -> str:
  """TFDS data_dir holding the prepared offline corpus (built once per machine).

  Preparation is idempotent (tfds reuses a finished build), so every test
  module can call this; only the first pays the ~3 s build.
  """
  from train.corpus import tfds_offline  # pylint: disable=g-import-not-at-top
  path = os.path.join(tempfile.gettempdir(),
                      f"twell_test_tfds_py{sys.version_info[0]}"
                      f"{sys.version_info[1]}_{os.getuid()}")
  tfds_offline.prepare(path)
  return path


def micro_config(**overrides):
  """configs/tiny.py shrunk further for fast tests."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  c.model.update(d_model=32, n_heads=2, n_kv_heads=1, d_ff=256)
  c.data.seq_len = 32
  c.batch_size = 8
  c.num_train_steps = 6
  c.warmup_steps = 2
  c.l1_warmup_steps = 0
  c.log_every = 2
  c.eval_every = 0
  c.eval_batches = 2
  c.checkpoint_every = 2
  c.data.data_dir = offline_data_dir()
  for k, v in overrides.items():
    target = c
    *parents, leaf = k.split(".")
    for p in parents:
      target = target[p]
    target[leaf] = v
  return c


def write_bpe_tokenizer(path: str, texts, vocab_size: int, **kwargs) -> str:
  """`build_tokenizer.build_bpe_json`: a byte-level BPE tokenizer.json (and its
  tokenizer_config.json) trained on `texts` into the directory `path`."""
  from train.corpus import build_tokenizer  # pylint: disable=g-import-not-at-top
  return build_tokenizer.build_bpe_json(path, texts, vocab_size, **kwargs)


def main_cmd(workdir: str, *flags: str) -> list[str]:
  """Command line for `python -m train.main` on the tiny config. Without
  tensorflow-datasets (the GPU image) the corpus is read from its generator, as the
  pipeline does for a user who lacks it."""
  from train.data import pipeline  # pylint: disable=g-import-not-at-top
  data = ([f"--config.data.data_dir={offline_data_dir()}"] if pipeline.tfds_available()
          else ["--config.data.use_tfds=False"])
  return [sys.executable, "-m", "train.main", "--config=configs/tiny.py",
          f"--workdir={workdir}", *data, *flags]


def run_env(**extra) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env


def run(cmd, timeout=300, **env) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, cwd=REPO, env=run_env(**env), timeout=timeout,
                        capture_output=True, text=True)


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of the checkpoints in `workdir`, ascending."""
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def restore_params(workdir: str, step: int):
  """The parameters of a workdir's checkpoint `step`, built from its own stored config."""
  from train.inference import loading  # pylint: disable=g-import-not-at-top
  return loading.load_checkpoint(workdir, step).params


def tree_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b) and
          all(np.array_equal(np.asarray(x), np.asarray(y))
              for x, y in zip(la, lb)))


class FastCompile:
  """Mixin for absltest classes: cheap XLA compiles inside this class only.

  `jax_disable_most_optimizations` is a global flag read at compile time, so
  it is switched on in setUpClass and back off in tearDownClass, leaving the
  rest of the test session (other modules' numerics) untouched.
  """

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    jax.config.update("jax_disable_most_optimizations", True)

  @classmethod
  def tearDownClass(cls):
    jax.config.update(
        "jax_disable_most_optimizations",
        os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "").lower()
        in ("1", "true"))
    super().tearDownClass()


_TRAINED: dict[str, str] = {}


def trained_workdir(kind: str = "relu") -> str:
  """A micro-config run trained once per test process and shared by the test modules that
  only read it (generation, Hugging Face interop, report). Callers must not write into it.

  "relu": the sparse model, 60 steps with evals and checkpoints at 30 and 60;
  "silu": the dense SiLU-gated model (no L1), 20 steps (a model to ReLUfy).
  """
  if kind not in _TRAINED:
    import atexit  # pylint: disable=g-import-not-at-top
    import shutil  # pylint: disable=g-import-not-at-top
    wd = tempfile.mkdtemp(prefix=f"twell_trained_{kind}_")
    atexit.register(shutil.rmtree, wd, ignore_errors=True)
    if kind == "relu":
      cfg = micro_config(num_train_steps=60, log_every=10, eval_every=30,
                         checkpoint_every=30, learning_rate=3e-3)
    elif kind == "silu":
      cfg = micro_config(num_train_steps=20, log_every=10, checkpoint_every=20,
                         learning_rate=3e-3, l1_coeff=0.0, **{
                             "model.ffn_activation": "silu",
                             "model.ffn_implementation": "dense"})
    else:
      raise ValueError(kind)
    train_cheaply(cfg, wd)
    _TRAINED[kind] = wd
  return _TRAINED[kind]


def train_cheaply(cfg, workdir: str) -> None:
  """Trains `cfg` in `workdir` with XLA's optimizations off (cheap compiles)."""
  from train.training import loop as train_lib  # pylint: disable=g-import-not-at-top
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    train_lib.train_and_evaluate(cfg, workdir)
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
