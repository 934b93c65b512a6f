"""Tests for the lm-evaluation-harness backend (`train.inference.lm_eval_backend`,
`python -m train.lm_eval`) and `benchmarks.lm_eval_check`: local tasks written here, a micro
model trained here, and every number against a direct computation with the model."""

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import twell_jax  # noqa: F401  (before the first JAX computation: the interpreter's threads)
import jax
import numpy as np
import pytest

# lm-eval is the optional `eval` extra: without it (a plain install, the GPU image) this file
# is skipped, not an error that stops the whole collection.
pytest.importorskip("lm_eval")
from lm_eval import utils as lm_utils
from lm_eval.api import instance as lm_instance

import docs_blocks
import train_test_util as tu
from benchmarks import lm_eval_check
from train import errors
from train.inference import generator
from train.inference import lm_eval_backend
from train.inference import loading
from train.models import transformer as model_lib

CONTEXT = 128
# Multiple-choice items: one with an empty context (lm-eval's prefix token alone), one whose
# context ends in a space (moved to the continuation), choices of several lengths.
ITEMS = [
    {"context": "def add(a, b):", "choices": ["return a + b", "pass", "import os"], "answer": 0},
    {"context": "", "choices": ["The", "import sys"], "answer": 1},
    {"context": "Return the ", "choices": ["value", "list of all the names", "x"], "answer": 0},
    {"context": "x" * 70, "choices": ["y", "z" * 20], "answer": 1},
]
# Passages: one under the context, one over twice of it (three rolling windows).
PASSAGES = ["A short passage about nothing much.",
            " ".join(f"word{i}" for i in range(50))]

_WORKDIR: list[str] = []


def workdir() -> str:
  """A micro model (context CONTEXT) trained for a few steps, once per test process."""
  if not _WORKDIR:
    wd = tempfile.mkdtemp(prefix="twell_lm_eval_")
    atexit.register(shutil.rmtree, wd, ignore_errors=True)
    cfg = tu.micro_config(**{"data.seq_len": CONTEXT, "num_train_steps": 4, "batch_size": 4,
                             "checkpoint_every": 4, "learning_rate": 3e-3})
    tu.train_cheaply(cfg, wd)
    _WORKDIR.append(wd)
  return _WORKDIR[0]


@pytest.fixture(scope="module")
def model():
  ck = loading.load_checkpoint(workdir())
  lm = model_lib.LanguageModel(ck.model_cfg)
  forward = jax.jit(lambda p, t: lm.apply(p, t)[0])

  def logprobs(seq: list[int]) -> np.ndarray:
    """log p(seq[t + 1] | seq[:t + 1]) for every t: the model on the row alone, unpadded."""
    logits = np.asarray(forward(ck.params, np.asarray([seq[:-1]], np.int32))[0], np.float64)
    logits -= logits.max(-1, keepdims=True)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return lp[np.arange(len(seq) - 1), seq[1:]]

  return ck, logprobs, forward


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tasks"))
  lm_eval_check.write_tasks(d, ITEMS, PASSAGES)
  return d


def _encode(ck, text: str) -> list[int]:
  return [int(t) for t in ck.tokenizer.encode(text)]


def _instance(kind: str, args, i: int = 0):
  return lm_instance.Instance(request_type=kind, doc={}, arguments=args, idx=i)


@pytest.mark.parametrize("prefill_ffn", ["auto", "xla"])
def test_numbers_equal_a_direct_computation(model, tasks_dir, prefill_ffn):
  """Both local tasks through lm-eval: every choice's log-likelihood, the accuracy, every
  passage's rolling log-likelihood and the word perplexity equal the model's own numbers on
  each row alone; with the dense FFN ("auto" on the CPU) and the portable sparse one."""
  ck, logprobs, _ = model
  gen = generator.from_checkpoint(ck, workdir(), prefill_ffn=prefill_ffn)
  lm = lm_eval_backend.TwellLM(gen, batch_size=3, progress=False)
  results = lm_eval_backend.run_tasks(lm, [lm_eval_check.CHOICE_TASK, lm_eval_check.PPL_TASK],
                                      include_path=tasks_dir, bootstrap_iters=0,
                                      log_samples=True)
  eos = int(ck.tokenizer.eos_id)
  got = lm_eval_check.item_loglikelihoods(results, lm_eval_check.CHOICE_TASK)
  correct = []
  for item, scores in zip(ITEMS, got):
    # lm-eval moves a context's trailing spaces to the continuation; the byte tokenizer
    # encodes a concatenation as the concatenation of the encodings.
    context = item["context"].rstrip()
    want = []
    for choice in item["choices"]:
      cont = _encode(ck, item["context"][len(context):] + " " + choice)
      want.append(logprobs([eos] + _encode(ck, context) + cont)[-len(cont):].sum())
    np.testing.assert_allclose(scores, want, atol=1e-4, rtol=1e-5)
    correct.append(int(np.argmax(want)) == item["answer"])
  assert results["results"][lm_eval_check.CHOICE_TASK]["acc,none"] == np.mean(correct)

  total, words = 0.0, 0
  got = lm_eval_check.item_loglikelihoods(results, lm_eval_check.PPL_TASK)
  for text, (score,) in zip(PASSAGES, got):
    want = sum(logprobs(ctx + cont)[-len(cont):].sum()
               for ctx, cont in map(lm_utils.make_disjoint_window,
                                    lm_utils.get_rolling_token_windows(
                                        _encode(ck, text), eos, CONTEXT, 1)))
    np.testing.assert_allclose(score, want, atol=1e-3, rtol=1e-5)
    total, words = total + want, words + len(re.split(r"\s+", text))
  ppl = results["results"][lm_eval_check.PPL_TASK]["word_perplexity,none"]
  np.testing.assert_allclose(ppl, np.exp(-total / words), rtol=1e-4)

  # A few static shapes: the 10 choices and the 4 rolling windows in 3-row batches, padded
  # to the 64 and 128 buckets, compile two programs.
  stats = lm.stats["loglikelihood"]
  # The longest row (91 tokens) opens the first batch at 128; the other three calls at 64.
  assert stats["requests"] == 10 and stats["calls"] == 4
  assert stats["padded_tokens"] == 3 * 128 + 3 * (3 * 64)
  assert lm.stats["loglikelihood_rolling"]["calls"] == 2
  shapes = {k[1] for k in gen._compiled if k[0] == "score"}   # pylint: disable=protected-access
  assert len(shapes) == 2
  assert lm.stats["loglikelihood"]["ffn"] == (["SS"] if prefill_ffn == "xla" else ["DD"])


def test_greedy_flags_and_generation(model):
  """is_greedy marks a continuation that is the argmax at each of its positions, and
  generate_until is the model's greedy continuation, cut at the first stop string."""
  ck, _, forward = model
  gen = generator.from_checkpoint(ck, workdir())
  lm = lm_eval_backend.TwellLM(gen, batch_size=2, progress=False)
  eos = int(ck.tokenizer.eos_id)
  context = [eos] + _encode(ck, "def main(argv):")
  greedy = list(context)
  for _ in range(4):
    logits = np.asarray(forward(ck.params, np.asarray([greedy], np.int32))[0, -1])
    greedy.append(int(np.argmax(logits)))
  cont = greedy[len(context):]
  other = cont[:-1] + [(cont[-1] + 1) % ck.model_cfg.vocab_size]
  rows = [(("", ""), context, cont), (("", ""), context, other), (("", ""), context, cont[:1])]
  flags = [g for _, g in lm._loglikelihood_tokens(rows)]   # pylint: disable=protected-access
  assert flags == [True, False, True]

  # generate_until: the same greedy tokens (up to EOS), decoded and cut at the stop string.
  new = cont[:cont.index(eos)] if eos in cont else cont
  text = ck.tokenizer.decode(new)
  stop = text[2:3] or "\x00"
  reqs = [_instance("generate_until", ("def main(argv):", {"until": [stop], "max_gen_toks": 4})),
          _instance("generate_until", ("def main(argv):", {"until": [], "max_gen_toks": 4}), 1),
          _instance("generate_until", ("x", {"until": ["\n\n"], "max_gen_toks": 2}), 2)]
  out = lm.generate_until(reqs)
  assert out[0] == text.split(stop, 1)[0] and out[1] == text
  assert lm.stats["generate_until"]["requests"] == 3


def test_bad_input_is_one_clear_line(model, tasks_dir):
  ck, _, _ = model
  gen = generator.from_checkpoint(ck, workdir())
  with pytest.raises(errors.ConfigError, match="batch_size must be >= 1; got 0"):
    lm_eval_backend.TwellLM(gen, batch_size=0)
  lm = lm_eval_backend.TwellLM(gen, batch_size=2, progress=False)
  long_context = "y" * (CONTEXT + 10)
  with pytest.raises(errors.ConfigError, match=r"a loglikelihood request of \d+ tokens .* "
                     "exceeds the context of 128 tokens .*lower --num_fewshot"):
    lm.loglikelihood([_instance("loglikelihood", (long_context, " z"))])
  with pytest.raises(errors.ConfigError, match="generate_until prompt of .* no room"):
    lm.generate_until([_instance("generate_until", (long_context, {"until": []}))])
  with pytest.raises(errors.ConfigError, match="include_path=/no/such/dir: no such directory"):
    lm_eval_backend.run_tasks(lm, ["x"], include_path="/no/such/dir")
  with pytest.raises(errors.ConfigError, match="num_fewshot must be >= 0"):
    lm_eval_backend.run_tasks(lm, ["x"], num_fewshot=-1)
  with pytest.raises(errors.ConfigError, match="name at least one task"):
    lm_eval_backend.run_tasks(lm, [], include_path=tasks_dir)
  # An unknown name, looked up in lm-eval's own tasks too, with the near names.
  with pytest.raises(errors.ConfigError, match=r"--tasks: unknown task 'arc_eazy', not in "
                     r"lm-eval's tasks or --include_path=.*; did you mean arc_easy"):
    lm_eval_backend.run_tasks(lm, ["arc_eazy"], include_path=tasks_dir)
  with pytest.raises(errors.ConfigError, match="config.model: dtype='int8' not in"):
    generator.from_checkpoint(ck, workdir(), dtype="int8")


def test_cli_without_a_checkpoint_is_one_line(tmp_path):
  proc = tu.run([sys.executable, "-m", "train.lm_eval", f"--workdir={tmp_path}",
                 "--tasks=arc_easy"], timeout=120)
  assert proc.returncode == 1, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "checkpoint" in last, proc.stderr[-2000:]


def _offline_env(tmp: str) -> dict:
  return {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
          "HF_DATASETS_CACHE": os.path.join(tmp, "hf_datasets"),
          "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


def test_docs_offline_form_runs(tmp_path):
  """docs/lm_eval.md's offline command (ARC-Easy's own task file on local data) and its
  Python form, on the micro model in place of /tmp/twell_tiny."""
  code = docs_blocks.find("lm_eval_offline").code.replace("/tmp/twell_tiny", workdir())
  env = tu.run_env(**_offline_env(str(tmp_path)))
  proc = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env, timeout=300,
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.search(r"\|arc_easy_local\|.*\|acc ", proc.stdout), proc.stdout
  assert "--- loglikelihood: 8 requests" in proc.stdout, proc.stdout
  record = json.loads((tmp_path / "lm_eval_local.json").read_text())
  assert record["results"]["arc_easy_local"]["sample_len"] == 2
  assert record["backend"]["loglikelihood"]["requests"] == 8

  python = docs_blocks.find("lm_eval_python").code.replace("/tmp/twell_tiny", workdir())
  cwd = os.getcwd()
  try:
    os.chdir(tmp_path)
    exec(compile(python, "docs/lm_eval.md", "exec"), {})   # pylint: disable=exec-used
  finally:
    os.chdir(cwd)


def test_check_smoke(tmp_path):
  """benchmarks.lm_eval_check on the micro model: the corpus tasks, our float32 run, the hf
  cross-check where torch and transformers are installed (else said to be skipped), and
  both timed runs."""
  model = lm_eval_check.load_model(str(tmp_path), workdir=workdir())
  assert model.source["step"] == 4 and model.active is not None   # logged by training
  record = lm_eval_check.check(str(tmp_path), model, items=6, passages=2, batch_size=4,
                               repeats=1, context_words=6, choice_words=2)
  assert record["tasks"] == {lm_eval_check.CHOICE_TASK: 6, lm_eval_check.PPL_TASK: 2}
  cross = record["cross_check"]
  if lm_eval_check.hf_missing() is None:
    assert cross["passed"], cross
  else:
    assert cross["skipped"].startswith("skipped: lm-eval's hf model needs torch")
  rates = record["throughput"]
  assert rates["auto"]["requests"] == rates["dense"]["requests"] == 24
  assert rates["auto"]["acc"] == rates["dense"]["acc"] == (
      record["ours_float32"][lm_eval_check.CHOICE_TASK]["acc,none"])
  assert rates["ratio"] > 0
  with pytest.raises(ValueError, match="exactly one of workdir, hf_dir and trained"):
    lm_eval_check.load_model(str(tmp_path), workdir=workdir(), trained="paper_0p5b")


@pytest.mark.gpu
def test_sparse_prefill_scores_like_dense_on_the_gpu(tmp_path):
  """On a Hopper GPU, a bf16 model's log-likelihoods with the sparse kernels in every layer
  ("mosaic_gpu") against the dense FFN, item by item."""
  from pallas_kernels import _target  # pylint: disable=import-outside-toplevel
  if not _target.on_hopper():
    pytest.skip("needs a Hopper GPU")
  from configs import tiny  # pylint: disable=import-outside-toplevel
  cfg = tiny.get_config()   # (no prepared dataset needed: the GPU image has no tfds)
  cfg.data.seq_len = 256
  cfg.model.update(dtype="bfloat16", d_model=256, n_heads=4, n_kv_heads=2, d_ff=1024)
  lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
  params = lm.init_params(jax.random.key(0))
  lm_eval_check.write_tasks(str(tmp_path), ITEMS, PASSAGES)
  scores = {}
  for ffn in ("dense", "mosaic_gpu"):
    backend = lm_eval_backend.TwellLM(generator.Generator(params, cfg, prefill_ffn=ffn),
                                      batch_size=4, progress=False)
    results = lm_eval_backend.run_tasks(backend, [lm_eval_check.CHOICE_TASK],
                                        include_path=str(tmp_path), bootstrap_iters=0,
                                        log_samples=True)
    scores[ffn] = lm_eval_check.item_loglikelihoods(results, lm_eval_check.CHOICE_TASK)
    assert backend.stats["loglikelihood"]["ffn"] == ["D" * 2 if ffn == "dense" else "S" * 2]
  for dense, sparse in zip(scores["dense"], scores["mosaic_gpu"]):
    np.testing.assert_allclose(sparse, dense, rtol=1e-2, atol=5e-2)
