r"""Downstream benchmarks of a checkpoint through lm-evaluation-harness.

  python -m train.lm_eval --workdir=W --tasks=arc_easy,hellaswag [--include_path=DIR \
      --num_fewshot=N --limit=N --batch_size=32 --out=results.json --step=N]

It restores the latest (or `--step`) checkpoint of W (a training workdir, or one that
`train.import_hf` made from a Hugging Face Llama directory), runs the tasks through lm-eval
with this model (`train.inference.lm_eval_backend`: batched, length-bucketed scoring on the
FFNs generation's prefill runs), prints lm-eval's table and the requests per second, and
writes the results as JSON to --out. Tasks come from lm-eval (their data from the Hugging Face
hub) or from task YAMLs in --include_path (their data from local files). Needs the `eval`
extra (`pip install -e .[eval]`).
"""

import logging

from train import cli
from train.inference import generator
from train.models import transformer


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_list("tasks", None, "lm-eval task (or group) names, comma-separated.")
  flags.DEFINE_string("include_path", None, "A directory of task YAMLs (local tasks and data).")
  flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per prompt (default: the "
                       "task's).")
  flags.DEFINE_float("limit", None, "Items per task at most (below 1: a fraction of them).")
  flags.DEFINE_integer("batch_size", 32, "Rows per model call.")
  flags.DEFINE_string("prefill_ffn", "auto", "auto (generation's per-layer choice), or one FFN "
                      "implementation for every layer (dense, ...).")
  flags.DEFINE_enum("dtype", None, list(transformer.DTYPES), "Compute dtype (default: the "
                    "model's).")
  flags.DEFINE_bool("prefix_eos", True, "Start every context with EOS (a document start).")
  flags.DEFINE_integer("bootstrap_iters", 100000, "lm-eval's bootstrap iterations for the "
                       "standard errors of non-mean metrics (0: none).")
  flags.DEFINE_bool("log_samples", False, "Keep every item's requests and responses in --out.")
  flags.DEFINE_bool("progress", True, "Show progress bars.")
  flags.DEFINE_string("out", None, "Write the results as JSON here.")
  flags.mark_flags_as_required(["workdir", "tasks"])


def main():
  from absl import flags  # pylint: disable=import-outside-toplevel
  from train import errors  # pylint: disable=import-outside-toplevel
  try:
    from train.inference import lm_eval_backend  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise errors.ConfigError(f"train.lm_eval needs lm-eval ({e}): pip install -e .[eval]"
                             ) from None
  f = flags.FLAGS
  logging.getLogger("lm_eval").setLevel(logging.WARNING)   # its per-task progress lines
  gen, step = generator.from_workdir(f.workdir, f.step, dtype=f.dtype,
                                     prefill_ffn=f.prefill_ffn)
  lm = lm_eval_backend.TwellLM(gen, batch_size=f.batch_size, prefix_eos=f.prefix_eos,
                               progress=f.progress)
  limit = None if f.limit is None else (int(f.limit) if f.limit >= 1 else f.limit)
  results = lm_eval_backend.run_tasks(
      lm, f.tasks, include_path=f.include_path, num_fewshot=f.num_fewshot, limit=limit,
      bootstrap_iters=f.bootstrap_iters, log_samples=f.log_samples)
  record = lm_eval_backend.report(results, lm, {
      "workdir": f.workdir, "step": step, "dtype": gen.model_cfg.dtype,
      "prefill_ffn": f.prefill_ffn, "batch_size": f.batch_size, "prefix_eos": f.prefix_eos})
  print(lm_eval_backend.table(results), flush=True)
  for kind, s in record["backend"].items():
    rate = s["requests_per_s"]
    print(f"--- {kind}: {s['requests']} requests in {s['calls']} calls, "
          + (f"{rate:,.1f} requests/s" if rate else "no timing")
          + f" (compiles {s['compile_s']:.1f} s); FFN per layer {', '.join(s['ffn'])}",
          flush=True)
  if f.out:
    lm_eval_backend.write_json(f.out, record)


if __name__ == "__main__":
  cli.run(main, _define_flags)
