r"""A twell-jax checkpoint as an lm-evaluation-harness model (the library of
`python -m train.lm_eval`).

  gen, step = train.inference.generator.from_workdir(W)
  lm = TwellLM(gen, batch_size=32)
  results = run_tasks(lm, ["arc_easy"], include_path=None)

`TwellLM` answers lm-eval's three request types with the model of a `Generator` (the one
`train.generate` runs, with its choice of FFN per layer):

* loglikelihood (context, continuation): the tokens of context + continuation go through one
  causal pass; the continuation's log-probability is the sum over its tokens, read at the
  last len(continuation) positions of the row (right-aligned, as lm-eval's `hf` model reads
  them), and is_greedy says whether every one of its tokens is the argmax there.
* loglikelihood_rolling (a document): lm-eval's rolling windows of at most the context, each
  token predicted once, summed.
* generate_until (context, gen_kwargs): `Generator.generate_ids` (greedy unless do_sample),
  cut at the first stop string.

Batches and shapes. Rows are sorted by length and packed `batch_size` to a call; each call is
right-padded to a length bucket (64, 128, 256, ... tokens, capped at the context) and to
`batch_size` rows, so a run compiles one program per bucket, not one per request. Padding
sits after a row's real tokens, where causal attention keeps it out of their view.

Tokens. With `prefix_eos` (the default) every context starts with the tokenizer's EOS id,
which is how the model saw a document begin in its packed training stream (the role BOS
plays for a Llama's tokenizer in lm-eval's `hf` model); an empty context is that EOS alone.
Without it a context is its text's tokens, and only empty contexts and rolling windows get
the EOS (lm-eval's `prefix_token_id`), which is what the `hf` model does with
`add_bos_token=False, prefix_token_id=<eos>`.

A request longer than the context (data.seq_len) is refused with a `ConfigError`, not
truncated: the numbers would no longer be the task's.
"""

from __future__ import annotations

import collections
import difflib
import json
import os
import time
from typing import Sequence

import numpy as np
from lm_eval.api import model as lm_model
from lm_eval import utils as lm_utils
import tqdm

from train import errors
from train.inference import generator as generator_lib

FIRST_BUCKET = 64
DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_GEN_TOKS = 256


def bucket_length(n: int, context: int) -> int:
  """The padded length of a row of `n` tokens: the first of 64, 128, 256, ... that holds it,
  at most `context`."""
  length = FIRST_BUCKET
  while length < n:
    length *= 2
  return min(length, context)


class TwellLM(lm_model.TemplateLM):
  """lm-eval's `LM` for a `Generator` (module docstring). `stats` gathers, per request type,
  requests, model calls, seconds in calls and in compiles, and the FFN per layer."""

  def __init__(self, generator: generator_lib.Generator, *,
               batch_size: int = DEFAULT_BATCH_SIZE, prefix_eos: bool = True,
               progress: bool = True):
    super().__init__()
    if int(batch_size) < 1:
      raise errors.ConfigError(f"batch_size must be >= 1; got {batch_size}")
    self.gen, self.batch_size = generator, int(batch_size)
    self.prefix_eos, self.progress = bool(prefix_eos), bool(progress)
    self.stats: dict[str, dict] = {}

  # ---- what lm-eval asks of a TemplateLM ----

  @property
  def eot_token_id(self) -> int:
    return int(self.gen.tokenizer.eos_id)

  @property
  def max_length(self) -> int:
    return self.gen.context

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 **kwargs) -> list[int]:
    del kwargs
    ids = [int(t) for t in self.gen.tokenizer.encode(string)]
    prefix = self.prefix_eos if add_special_tokens is None else add_special_tokens
    return [self.eot_token_id] + ids if prefix else ids

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self.gen.tokenizer.decode(tokens)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    del kwargs
    rows = [(list(ctx) + list(cont), len(cont)) for _, ctx, cont in requests]
    results = self.score(rows, kind="loglikelihood", disable_tqdm=disable_tqdm)
    for (args, _, _), result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", args, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for i, req in enumerate(requests):
      tokens = self.tok_encode(req.args[0], add_special_tokens=False)
      for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=tokens, prefix_token=self.eot_token_id, max_seq_len=self.max_length,
          context_len=1)):
        windows.append((ctx + cont, len(cont)))
        owner.append(i)
    totals = [0.0] * len(requests)
    scores = self.score(windows, kind="loglikelihood_rolling", requests=len(requests),
                        disable_tqdm=disable_tqdm)
    for i, (logprob, _) in zip(owner, scores):
      totals[i] += logprob
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    groups = collections.defaultdict(list)
    for i, req in enumerate(requests):
      context, gen_kwargs = req.args
      groups[json.dumps(gen_kwargs, sort_keys=True, default=str)].append((i, context))
    out = [""] * len(requests)
    bar = tqdm.tqdm(total=len(requests), desc="generate_until",
                    disable=disable_tqdm or not self.progress)
    t0 = time.perf_counter()
    for key, items in groups.items():
      for i, text in self._generate_group(items, json.loads(key)):
        out[i] = text
        bar.update(1)
        self.cache_hook.add_partial("generate_until", requests[i].args, text)
    bar.close()
    self._record("generate_until", len(requests), time.perf_counter() - t0)
    return out

  # ---- scoring ----

  def score(self, rows: Sequence[tuple[list[int], int]], *, kind: str = "loglikelihood",
            requests: int | None = None, disable_tqdm: bool = False
            ) -> list[tuple[float, bool]]:
    """(log p(the last n tokens of each row | the tokens before them), all n greedy) for
    rows of (tokens, n), answering `requests` of lm-eval's (default: one a row)."""
    for tokens, n in rows:
      if len(tokens) - 1 > self.max_length:
        raise errors.ConfigError(
            f"a {kind} request of {len(tokens) - 1} tokens (context and continuation, less "
            f"the last) exceeds the context of {self.max_length} tokens this model was "
            "trained on (data.seq_len): lower --num_fewshot or shorten the task's prompts")
      if not 0 <= n < len(tokens):
        raise errors.ConfigError(f"a {kind} request scores {n} of its {len(tokens)} tokens")
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    results: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
    bar = tqdm.tqdm(total=len(rows), desc=kind, disable=disable_tqdm or not self.progress)
    t0 = time.perf_counter()
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      for i, result in zip(batch, self._score_batch([rows[i] for i in batch], kind)):
        results[i] = result
      bar.update(len(batch))
    bar.close()
    self._record(kind, len(rows) if requests is None else requests, time.perf_counter() - t0)
    return results

  def _score_batch(self, rows, kind: str) -> list[tuple[float, bool]]:
    """One model call on `rows` (at most batch_size, sorted longest first)."""
    length = bucket_length(len(rows[0][0]) - 1, self.max_length)
    tokens = np.zeros((self.batch_size, length), np.int32)
    targets = np.zeros((self.batch_size, length), np.int32)
    for r, (seq, _) in enumerate(rows):
      tokens[r, :len(seq) - 1] = seq[:-1]
      targets[r, :len(seq) - 1] = seq[1:]
    logprobs, greedy, call = self.gen.score_ids(tokens, targets)
    self._record(kind, 0, 0.0, call=call, tokens=sum(len(s) - 1 for s, _ in rows),
                 padded=tokens.size)
    out = []
    for r, (seq, n) in enumerate(rows):
      span = slice(len(seq) - 1 - n, len(seq) - 1)   # the continuation's targets
      out.append((float(np.sum(logprobs[r, span], dtype=np.float64)),
                  bool(np.all(greedy[r, span]))))
    return out

  # ---- generation ----

  def _generate_group(self, items, gen_kwargs: dict):
    """(index, text) of each (index, context) sharing `gen_kwargs`."""
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    max_new = int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
    if gen_kwargs.get("do_sample") and float(gen_kwargs.get("temperature", 1.0)) > 0:
      sampling = generator_lib.Sampling(float(gen_kwargs.get("temperature", 1.0)),
                                        int(gen_kwargs.get("top_k", 0) or 0),
                                        float(gen_kwargs.get("top_p", 1.0) or 1.0))
    else:
      sampling = generator_lib.Sampling(temperature=0.0)
    prompts = []
    for i, context in items:
      ids = self.tok_encode(context) or [self.eot_token_id]
      if len(ids) >= self.max_length:
        raise errors.ConfigError(
            f"a generate_until prompt of {len(ids)} tokens leaves no room in the context of "
            f"{self.max_length} tokens this model was trained on (data.seq_len): lower "
            "--num_fewshot or shorten the task's prompts")
      prompts.append((i, ids, min(max_new, self.max_length - len(ids))))
    prompts.sort(key=lambda p: (p[2], -len(p[1])))
    for start in range(0, len(prompts), self.batch_size):
      batch = prompts[start:start + self.batch_size]
      # Rows of one call share max_new_tokens: the batch's least room.
      steps = min(p[2] for p in batch)
      ids = [p[1] for p in batch] + [batch[-1][1]] * (self.batch_size - len(batch))
      t0 = time.perf_counter()
      gen = self.gen.generate_ids(ids, max_new_tokens=steps, sampling=sampling)
      seconds = gen.stats["prefill_s"] + gen.stats["decode_s"]
      # The rest of the call's time is its compiles (and a little host work).
      self._record("generate_until", 0, 0.0, call={
          "seconds": seconds, "compile_s": time.perf_counter() - t0 - seconds,
          "ffn": gen.stats["prefill_ffn"]})
      for (i, _, _), new in zip(batch, gen.tokens):
        yield i, _cut(self.tok_decode(new), until)

  def _record(self, kind: str, requests: int, wall_s: float, *, call: dict | None = None,
              tokens: int = 0, padded: int = 0) -> None:
    s = self.stats.setdefault(kind, {"requests": 0, "wall_s": 0.0, "calls": 0, "call_s": 0.0,
                                     "compile_s": 0.0, "tokens": 0, "padded_tokens": 0,
                                     "ffn": []})
    s["requests"] += requests
    s["wall_s"] += wall_s
    s["tokens"] += tokens
    s["padded_tokens"] += padded
    if call is not None:
      s["calls"] += 1
      s["call_s"] += call["seconds"]
      s["compile_s"] += call["compile_s"]
      if call["ffn"] not in s["ffn"]:
        s["ffn"].append(call["ffn"])


def _cut(text: str, until: Sequence[str]) -> str:
  """`text` up to the first of the stop strings `until`."""
  for stop in until:
    if stop:
      text = text.split(stop, 1)[0]
  return text


# ---- running tasks ----

def task_manager(tasks: Sequence[str], include_path: str | None = None):
  """lm-eval's `TaskManager` that knows every name in `tasks`: the tasks of `include_path`
  alone when they hold them all (indexing lm-eval's own ~15k task files takes seconds), else
  with lm-eval's. An unknown name is a `ConfigError` naming it."""
  from lm_eval import tasks as lm_tasks  # pylint: disable=import-outside-toplevel
  if not tasks:
    raise errors.ConfigError("--tasks: name at least one task")
  if include_path:
    if not os.path.isdir(include_path):
      raise errors.ConfigError(f"--include_path={include_path}: no such directory")
    local = lm_tasks.TaskManager(include_path=include_path, include_defaults=False)
    if all(t in local.all_tasks for t in tasks):
      return local
  manager = lm_tasks.TaskManager(include_path=include_path)
  for name in tasks:
    if name not in manager.all_tasks:
      close = difflib.get_close_matches(name, manager.all_tasks, n=3)
      where = "lm-eval's tasks" + (f" or --include_path={include_path}" if include_path else "")
      hint = f"; did you mean {', '.join(close)}?" if close else ""
      raise errors.ConfigError(f"--tasks: unknown task {name!r}, not in {where}{hint}")
  return manager


def run_tasks(lm: TwellLM, tasks: Sequence[str], *, include_path: str | None = None,
              num_fewshot: int | None = None, limit: float | None = None,
              bootstrap_iters: int = 100000, log_samples: bool = False) -> dict:
  """lm-eval's `simple_evaluate` of `tasks` on `lm`: its results dict (with "samples", each
  item's requests and responses, when `log_samples`)."""
  from lm_eval import evaluator  # pylint: disable=import-outside-toplevel
  if num_fewshot is not None and num_fewshot < 0:
    raise errors.ConfigError(f"num_fewshot must be >= 0; got {num_fewshot}")
  if limit is not None and limit <= 0:
    raise errors.ConfigError(f"limit must be > 0; got {limit}")
  if bootstrap_iters < 0:
    raise errors.ConfigError(f"bootstrap_iters must be >= 0; got {bootstrap_iters}")
  manager = task_manager(tasks, include_path)
  return evaluator.simple_evaluate(
      model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
      task_manager=manager, log_samples=log_samples, bootstrap_iters=bootstrap_iters)


def report(results: dict, lm: TwellLM, model: dict) -> dict:
  """The JSON record of a run: `model` (what was evaluated), lm-eval's results, the backend's
  `stats` (requests per second by request type, not counting compiles), and the samples if
  the run logged them."""
  backend = {}
  for kind, s in lm.stats.items():
    run_s = s["wall_s"] - s["compile_s"]
    backend[kind] = {**s, "requests_per_s": s["requests"] / run_s if run_s > 0 else None}
  keep = ("results", "groups", "versions", "n-shot", "n-samples", "higher_is_better",
          "lm_eval_version", "date", "samples")
  return {"model": model, "backend": backend, **{k: results[k] for k in keep if k in results}}


def table(results: dict) -> str:
  """lm-eval's markdown table of the results (and of the groups, if any)."""
  text = lm_utils.make_table(results)
  if results.get("groups"):
    text += "\n" + lm_utils.make_table(results, "groups")
  return text


def write_json(path: str, record: dict) -> None:
  with open(path, "w") as f:
    json.dump(record, f, indent=1, default=lm_utils.handle_non_serializable)
    f.write("\n")
