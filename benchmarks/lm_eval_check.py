r"""lm-evaluation-harness on our backend: cross-checked against lm-eval's `hf` model, and timed
sparse against dense.

    python -m benchmarks.lm_eval_check --workdir=W --out=R.json          # a training workdir
    python -m benchmarks.lm_eval_check --hf_dir=D --out=R.json           # a Llama directory
    python -m benchmarks.lm_eval_check --trained=paper_0p5b --out=R.json # benchmarks.common.trained's
    python -m benchmarks.lm_eval_check --workdir=W --out=R.json --smoke  # CPU, a tiny model

The model: W's latest checkpoint; D imported (`train.import_hf`, configs/default.py's
settings); or the paper shape trained to the paper-like activity (`benchmarks.common.trained`,
cached on the machine: the weights the decode and e2e benchmarks time). Files go to
--scratch (default: a temporary directory, removed after).

Two local tasks are written to SCRATCH/tasks (`write_tasks`) from held-out documents of the
offline corpus (`twell_stdlib_text`, validation split): "twell_next_passage", multiple
choice (a passage's opening; the passage's next words against the words at the same place in
three other passages), and "twell_passages", perplexity (loglikelihood_rolling over
passages).

(a) Cross-check. The model is written as a Hugging Face Llama directory (`train.export_hf`;
D itself when given), and both tasks run through our backend
(`train.inference.lm_eval_backend`) and through lm-eval's own `hf` model (torch +
transformers) on that directory, both in float32 (full-precision products), with the same
tokens (contexts as their text's tokens, the EOS id as lm-eval's prefix token: our
`prefix_eos=False`, the hf model's `add_bos_token=False, prefix_token_id=EOS`). Passes when
every item's log-likelihood (each choice, each passage) is within `TOLERANCE` and the
accuracies are equal. Without torch or transformers (CI) this side is skipped and said so.

(b) Throughput. The multiple-choice task's loglikelihood requests through our backend in the
model's own dtype with the FFN generation's prefill runs ("auto": the sparse kernels per
layer where they win, by the activity training logged, else measured on the first pass) and
with the dense FFN, each timed warm (the median of `--repeats` passes after an untimed one)
as requests/s; "ratio" is sparse over dense. The "auto" run's log-likelihoods are also
compared with the hf model's float32 ones ("model_dtype_vs_hf": reported, not checked, a
16-bit model differs from float32 by its rounding).

JSON (--out): {"device", "model", "tasks", "ours_float32", "cross_check":
{"passed", "max_abs_diff", "acc_ours", "acc_hf", ...}, "model_dtype_vs_hf", "throughput":
{"auto", "dense", "ratio"}}. Exit status 1 when the cross-check ran and failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

TOLERANCE = 2e-2
CHOICE_TASK, PPL_TASK = "twell_next_passage", "twell_passages"
# lm-eval's perplexity metrics of a loglikelihood_rolling task, with their aggregations.
_PPL_METRICS = (("word_perplexity", "weighted_perplexity"),
                ("byte_perplexity", "weighted_perplexity"), ("bits_per_byte", "bits_per_byte"))


# ---- the local tasks ----

def write_tasks(directory: str, items: list[dict], passages: list[str]) -> list[str]:
  """Writes the two tasks into `directory`: CHOICE_TASK over `items` ({"context", "choices",
  "answer"}: the continuation is " " + a choice) and PPL_TASK over `passages`, each a YAML
  beside its data as JSON lines. Returns the task names."""
  os.makedirs(directory, exist_ok=True)
  cache = os.path.join(directory, "datasets_cache")
  specs = {
      CHOICE_TASK: (items, "multiple_choice",
                    'doc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
                    'doc_to_choice: "{{choices}}"\nmetric_list:\n'
                    "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"),
      PPL_TASK: ([{"text": p} for p in passages], "loglikelihood_rolling",
                 'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
                 + "".join(f"  - metric: {m}\n    aggregation: {agg}\n"
                           "    higher_is_better: false\n" for m, agg in _PPL_METRICS)),
  }
  for name, (rows, output_type, body) in specs.items():
    data = os.path.join(os.path.abspath(directory), f"{name}.jsonl")
    with open(data, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
      f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
              f"    test: {json.dumps(data)}\n  cache_dir: {json.dumps(os.path.abspath(cache))}\n"
              f"output_type: {output_type}\ntest_split: test\n{body}"
              "metadata:\n  version: 1.0\n")
  return [CHOICE_TASK, PPL_TASK]


def corpus_tasks(n_items: int, n_passages: int, *, context_words: int, choice_words: int,
                 max_bytes: int, passage_bytes: int, seed: int = 0
                 ) -> tuple[list[dict], list[str]]:
  """Multiple-choice items and passages from the offline corpus's validation documents
  (module docstring), whitespace-normalised. An item's context and longest choice hold at
  most `max_bytes` UTF-8 bytes (so at most that many tokens of a byte or subword tokenizer),
  a passage at most `passage_bytes` (longer than the context: several rolling windows)."""
  from train.corpus import text_corpus  # pylint: disable=import-outside-toplevel
  docs = [t.split() for _, t in text_corpus.iter_documents("validation")]
  docs = [d for d in docs if len(d) >= context_words + choice_words]
  rng = random.Random(seed)
  rng.shuffle(docs)
  span = lambda doc, start, count: " ".join(doc[start:start + count])
  size = lambda text: len(text.encode("utf-8"))
  items, used = [], 0
  for i, doc in enumerate(docs[:-3]):
    if len(items) == n_items:
      break
    used = i + 1
    wrong = [span(o, context_words, choice_words) for o in docs[i + 1:i + 4]]
    answer = rng.randrange(4)
    item = {"context": span(doc, 0, context_words),
            "choices": wrong[:answer] + [span(doc, context_words, choice_words)]
                       + wrong[answer:],
            "answer": answer}
    if size(item["context"]) + 1 + max(map(size, item["choices"])) <= max_bytes:
      items.append(item)
  passages = []
  for doc in docs[used:]:
    text = " ".join(doc)
    while size(text) > passage_bytes:
      text = text.rsplit(" ", 1)[0] if " " in text else text[:passage_bytes // 4]
    passages.append(text)
    if len(passages) == n_passages:
      break
  if len(items) < n_items or len(passages) < n_passages:
    raise ValueError(f"the corpus gave {len(items)} items of at most {max_bytes} bytes and "
                     f"{len(passages)} passages, fewer than the {n_items} and {n_passages} "
                     "asked")
  return items, passages


# ---- per-item numbers out of lm-eval's samples ----

def item_loglikelihoods(results: dict, task: str) -> list[list[float]]:
  """Per item (in doc order), the log-likelihood of each of its requests."""
  samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
  out = []
  for s in samples:
    out.append([float(r[0]) if isinstance(r, (list, tuple)) else float(r)
                for r in s["filtered_resps"]])
  return out


def compare(ours: dict, theirs: dict, tasks: list[str]) -> dict:
  """Per-item log-likelihood differences and the accuracies of two runs of `tasks`."""
  diffs, per_task = [], {}
  for task in tasks:
    a, b = item_loglikelihoods(ours, task), item_loglikelihoods(theirs, task)
    if len(a) != len(b):
      raise ValueError(f"{task}: {len(a)} items against {len(b)}")
    d = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb, strict=True)]
    diffs.extend(d)
    per_task[task] = {"items": len(a), "max_abs_diff": max(d, default=0.0)}
  acc = lambda r: r["results"][CHOICE_TASK]["acc,none"]
  out = {"tasks": per_task, "max_abs_diff": max(diffs, default=0.0),
         "mean_abs_diff": sum(diffs) / max(1, len(diffs)),
         "acc_ours": acc(ours), "acc_hf": acc(theirs)}
  out["passed"] = out["max_abs_diff"] <= TOLERANCE and out["acc_ours"] == out["acc_hf"]
  return out


# ---- the two models ----

def hf_missing() -> str | None:
  """Why lm-eval's `hf` model cannot run here (torch or transformers missing), or None."""
  try:
    import torch  # pylint: disable=import-outside-toplevel,unused-import
    import transformers  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    return f"skipped: lm-eval's hf model needs torch and transformers ({e})"
  return None


def hf_model(hf_dir: str, *, eos_id: int, context: int, batch_size: int):
  """lm-eval's `hf` model on `hf_dir` in float32 with our token conventions (module
  docstring), on the GPU where torch sees one."""
  import torch  # pylint: disable=import-outside-toplevel
  from lm_eval.models import huggingface  # pylint: disable=import-outside-toplevel
  device = "cuda" if torch.cuda.is_available() else "cpu"
  return huggingface.HFLM(pretrained=hf_dir, dtype="float32", batch_size=batch_size,
                          device=device, add_bos_token=False, prefix_token_id=eos_id,
                          max_length=context)


def _recording_lm(generator, batch_size: int, prefix_eos: bool):
  """Our backend, keeping the loglikelihood requests it was given (to time them again)."""
  from train.inference import lm_eval_backend  # pylint: disable=import-outside-toplevel

  class Recording(lm_eval_backend.TwellLM):
    requests = None

    def loglikelihood(self, requests, disable_tqdm: bool = False):
      self.requests = requests
      return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

  return Recording(generator, batch_size=batch_size, prefix_eos=prefix_eos, progress=False)


def timed(lm, repeats: int) -> dict:
  """Requests/s of `lm`'s recorded loglikelihood requests: the median of `repeats` passes
  after one more untimed one (a plan measured on the first pass compiles anew)."""
  lm.loglikelihood(lm.requests, disable_tqdm=True)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    lm.loglikelihood(lm.requests, disable_tqdm=True)
    times.append(time.perf_counter() - t0)
  s = statistics.median(times)
  return {"requests": len(lm.requests), "median_s": s, "requests_per_s": len(lm.requests) / s,
          "ffn": lm.stats["loglikelihood"]["ffn"][-1]}


@dataclasses.dataclass
class Model:
  """What is evaluated: parameters with their training config and tokenizer, the activity
  per layer training logged (None: the first "auto" pass measures it), and where it came
  from."""
  params: dict
  config: Any
  tokenizer: Any
  active: list[float] | None
  source: dict

  def generator(self, **kwargs):
    from train.inference import generator  # pylint: disable=import-outside-toplevel
    return generator.Generator(self.params, self.config, tokenizer=self.tokenizer,
                               active_per_token=self.active, **kwargs)


def load_model(out_dir: str, *, workdir: str | None = None, hf_dir: str | None = None,
               trained: str | None = None, trained_steps: int = 1500) -> Model:
  """The latest checkpoint of `workdir`; or `hf_dir` imported into out_dir/workdir (with
  configs/default.py's training settings); or `trained`, a shape's weights trained to the
  paper-like activity by `benchmarks.common.trained` (cached: the ones the decode and e2e
  benchmarks time)."""
  from train.inference import generator  # pylint: disable=import-outside-toplevel
  from train.inference import loading  # pylint: disable=import-outside-toplevel
  if sum(x is not None for x in (workdir, hf_dir, trained)) != 1:
    raise ValueError("give exactly one of workdir, hf_dir and trained")
  if trained is not None:
    from benchmarks.common import trained as trained_lib  # pylint: disable=import-outside-toplevel
    from train.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
    cfg, params = trained_lib.trained_params(trained, "paper", steps=trained_steps,
                                             extreme_steps=0)
    return Model(params, cfg, tokenizer_lib.make_tokenizer(cfg.data), None,
                 {"trained": trained, "steps": trained_steps})
  if hf_dir is not None:
    from configs import default  # pylint: disable=import-outside-toplevel
    from train.hf import importing  # pylint: disable=import-outside-toplevel
    workdir = os.path.join(out_dir, "workdir")
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
      importing.import_checkpoint(hf_dir, workdir, default.get_config())
  ck = loading.load_checkpoint(workdir)
  return Model(ck.params, ck.config, ck.tokenizer,
               generator.logged_activity(workdir, ck.step, ck.model_cfg.n_layers),
               {"workdir": workdir, "hf_dir": hf_dir, "step": ck.step})


def cross_check(model: Model, out_dir: str, run, tasks: list[str], *, batch_size: int,
                hf_dir: str | None) -> tuple[dict, dict | None]:
  """(a) of the module docstring: (the record, the hf model's results or None)."""
  import jax  # pylint: disable=import-outside-toplevel
  from train.hf import exporting  # pylint: disable=import-outside-toplevel
  # Full float32 products: on a GPU, JAX's default precision multiplies float32 matrices in
  # TF32 (torch does not).
  with jax.default_matmul_precision("highest"):
    ours = run(_recording_lm(model.generator(dtype="float32"), batch_size, prefix_eos=False),
               tasks)
  record = {"ours_float32": {t: ours["results"][t] for t in tasks}}
  why = hf_missing()
  if why is not None:
    return {**record, "cross_check": {"skipped": why}}, None
  if hf_dir is None:
    hf_dir = os.path.join(out_dir, "hf")
    exporting.write_hf_dir(hf_dir, model.params, model.config, model.tokenizer, overwrite=True)
  theirs = run(hf_model(hf_dir, eos_id=int(model.tokenizer.eos_id),
                        context=int(model.config.data.seq_len), batch_size=batch_size), tasks)
  return {**record, "cross_check": {"tolerance": TOLERANCE, **compare(ours, theirs, tasks)}}, theirs


def throughput(model: Model, run, *, batch_size: int, repeats: int, theirs: dict | None
               ) -> dict:
  """(b) of the module docstring: the record. One generator serves both runs (its compiled
  programs are kept by FFN choice): "auto" first, whose activity-measuring first pass, where
  training logged none, compiles the dense program the dense run then reuses."""
  gen = model.generator(prefill_ffn="auto")
  rates, record = {}, {}
  for name in ("auto", "dense"):
    gen.plan.prefill_ffn = name
    lm = _recording_lm(gen, batch_size, prefix_eos=False)
    results = run(lm, [CHOICE_TASK])
    rates[name] = {**timed(lm, repeats), "acc": results["results"][CHOICE_TASK]["acc,none"]}
    if name == "auto" and theirs is not None:
      diff = compare(results, theirs, [CHOICE_TASK])
      diff.pop("passed")
      record["model_dtype_vs_hf"] = diff
  rates["ratio"] = rates["auto"]["requests_per_s"] / rates["dense"]["requests_per_s"]
  return {**record, "throughput": rates}


def check(out_dir: str, model: Model, *, hf_dir: str | None = None, items: int = 64,
          passages: int = 8, batch_size: int = 32, repeats: int = 5, context_words: int = 24,
          choice_words: int = 6) -> dict:
  """Runs (a) and (b) of the module docstring on `model` (`hf_dir`: its Hugging Face
  directory, if it came from one); returns the JSON record."""
  import jax  # pylint: disable=import-outside-toplevel
  from train.inference import lm_eval_backend  # pylint: disable=import-outside-toplevel
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  os.makedirs(out_dir, exist_ok=True)
  context = int(model.config.data.seq_len)
  # Items and passages of at most 250 bytes: at a long context every row fits the 256 bucket
  # (one program to compile per run); a short one (the smoke mode's) has passages of several
  # windows.
  mc_items, texts = corpus_tasks(items, passages, context_words=context_words,
                                 choice_words=choice_words, max_bytes=min(context - 2, 250),
                                 passage_bytes=min(3 * context, 250))
  include = os.path.join(out_dir, "tasks")
  tasks = write_tasks(include, mc_items, texts)
  run = lambda lm, names: lm_eval_backend.run_tasks(lm, names, include_path=include,
                                                    bootstrap_iters=0, log_samples=True)
  mc = model_lib.ModelConfig.from_config(model.config.model)
  record = {"device": jax.devices()[0].device_kind,
            "model": {**model.source, "dtype": mc.dtype, "context": context,
                      "n_layers": mc.n_layers, "d_model": mc.d_model, "d_ff": mc.d_ff,
                      "tokenizer": model.config.data.tokenizer,
                      "logged_activity": model.active is not None},
            "tasks": {CHOICE_TASK: len(mc_items), PPL_TASK: len(texts)}}
  checked, theirs = cross_check(model, out_dir, run, tasks, batch_size=batch_size,
                                hf_dir=hf_dir)
  record.update(checked)
  record.update(throughput(model, run, batch_size=batch_size, repeats=repeats, theirs=theirs))
  return record


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "A training workdir (its latest checkpoint).")
  flags.DEFINE_string("hf_dir", None, "Or a Hugging Face Llama directory (imported).")
  flags.DEFINE_string("trained", None, "Or a shape (paper_0p5b) trained to the paper-like "
                      "activity by benchmarks.common.trained (cached).")
  flags.DEFINE_integer("trained_steps", 1500, "Training steps of --trained (the cache's name).")
  flags.DEFINE_string("out", None, "Write the JSON record here.")
  flags.DEFINE_string("scratch", None, "Directory for the tasks, the exported model and an "
                      "imported workdir (default: a temporary one, removed after).")
  flags.DEFINE_integer("items", 64, "Multiple-choice items (four requests each).")
  flags.DEFINE_integer("passages", 8, "Perplexity passages.")
  flags.DEFINE_integer("batch_size", 32, "Rows per model call, both backends.")
  flags.DEFINE_integer("repeats", 5, "Timed passes over the requests.")
  flags.DEFINE_bool("smoke", False, "CPU smoke mode: a few short items, one timed pass.")
  flags.mark_flag_as_required("out")


def main(argv):
  from absl import flags  # pylint: disable=import-outside-toplevel
  del argv
  f = flags.FLAGS
  # No hub on the machines this runs on; leave the GPU room for torch beside JAX.
  for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                     ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")):
    os.environ.setdefault(key, value)
  size = (dict(items=6, passages=2, batch_size=4, repeats=1, context_words=6, choice_words=2)
          if f.smoke else dict(items=f.items, passages=f.passages, batch_size=f.batch_size,
                               repeats=f.repeats))
  t0 = time.perf_counter()
  scratch = f.scratch or tempfile.mkdtemp(prefix="twell_lm_eval_check_")
  try:
    model = load_model(scratch, workdir=f.workdir, hf_dir=f.hf_dir, trained=f.trained,
                       trained_steps=f.trained_steps)
    record = check(scratch, model, hf_dir=f.hf_dir, **size)
  finally:
    if not f.scratch:
      shutil.rmtree(scratch, ignore_errors=True)
  record["wall_s"] = time.perf_counter() - t0
  os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
  with open(f.out, "w") as fh:
    json.dump(record, fh, indent=1)
  cross, rates = record["cross_check"], record["throughput"]
  print("cross-check " + (cross["skipped"] if "skipped" in cross else
        f"{'PASS' if cross['passed'] else 'FAIL'}: max |diff| {cross['max_abs_diff']:.2e} "
        f"(tolerance {TOLERANCE}), acc ours {cross['acc_ours']:.4f} hf {cross['acc_hf']:.4f}"))
  print(f"loglikelihood requests/s: auto {rates['auto']['requests_per_s']:,.1f} (FFN "
        f"{rates['auto']['ffn']}), dense {rates['dense']['requests_per_s']:,.1f}, ratio "
        f"{rates['ratio']:.3f}; {record['wall_s']:.0f} s in all", flush=True)
  if not cross.get("passed", True):
    sys.exit(1)


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)
