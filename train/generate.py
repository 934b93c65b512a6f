r"""Text generation from a checkpoint with a KV cache.

  python -m train.generate --workdir=W --prompt="def add(a, b):" [--max_new_tokens=48 \
      --temperature=0.8 --top_k=40 --top_p=0.95 --seed=0 --num_samples=1 --step=N]
  python -m train.generate --workdir=W --prompts_file=prompts.txt     # one prompt a line

It restores the latest (or `--step`) checkpoint of W with the config saved beside it, prints
each prompt followed by its completion, then how fast decoding ran. The library, with which
FFN and attention run where: `train.inference.generator`.
"""

import json

from train import cli
from train.inference import generator
from train.models import implementations


def _define_flags():
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "Training workdir holding checkpoints/.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_string("prompt", None, "The prompt (or --prompts_file).")
  flags.DEFINE_string("prompts_file", None, "A text file with one prompt a line, run as one "
                      "batch.")
  flags.DEFINE_integer("num_samples", 1, "Completions per prompt (rows of the batch).")
  flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate per row at most (default: "
                       f"up to the context, at most {generator.DEFAULT_MAX_NEW_TOKENS}).")
  flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0: greedy.")
  flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0: all.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass; 1: off.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_bool("stop_at_eos", True, "Stop a row at EOS (off: always max_new_tokens, for "
                    "timing).")
  flags.DEFINE_bool("prefix_eos", True, "Start each prompt with EOS (a document start).")
  flags.DEFINE_string("prefill_ffn", "auto", "auto, or one FFN implementation for all layers.")
  flags.DEFINE_enum("decode_ffn", "auto", implementations.DECODE_FFN, "FFN at decode: auto (sparse kernels "
                    "per layer where few features fire in the batch), dense, sparse (every "
                    "layer) or same (the prefill's per-layer choice).")
  flags.DEFINE_enum("decode_attention", "auto", implementations.DECODE_ATTENTION, "Attention at decode: auto "
                    "(the one-kernel decode attention where it runs), kernel, or xla.")
  flags.DEFINE_string("out", None, "Also write the completions and stats as JSON here.")
  flags.mark_flag_as_required("workdir")


def main():
  from absl import app  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  f = flags.FLAGS
  if (f.prompt is None) == (f.prompts_file is None):
    raise app.UsageError("give exactly one of --prompt and --prompts_file")
  if f.prompt is not None:
    prompts = [f.prompt]
  else:
    with open(f.prompts_file) as fh:
      prompts = [line.rstrip("\n") for line in fh if line.strip()]
    if not prompts:
      raise app.UsageError(f"{f.prompts_file} holds no prompt")
  prompts = [p for p in prompts for _ in range(max(1, f.num_samples))]
  gen, step = generator.from_workdir(f.workdir, f.step, prefill_ffn=f.prefill_ffn,
                                     decode_ffn=f.decode_ffn,
                                     decode_attention=f.decode_attention)
  out = gen(prompts, max_new_tokens=f.max_new_tokens, seed=f.seed,
            sampling=generator.Sampling(f.temperature, f.top_k, f.top_p),
            stop_at_eos=f.stop_at_eos, prefix_eos=f.prefix_eos)
  for i, (prompt, text) in enumerate(zip(prompts, out.texts)):
    print(f"=== {i}\n{prompt}{text}", flush=True)
  s = out.stats
  print(f"--- checkpoint step {step}; {s['device']}; batch {s['batch']}: prefill "
        f"{s['prompt_tokens_padded']} tokens/row in {s['prefill_s'] * 1e3:.1f} ms "
        f"(FFN per layer {s['prefill_ffn']}); decode {s['decode_steps']} steps in "
        f"{s['decode_s'] * 1e3:.1f} ms = {s['decode_tokens_per_s']:,.1f} tokens/s "
        f"({s['decode_ms_per_step']:.2f} ms/step, FFN per layer {s['decode_ffn']}); "
        f"compile {s['compile_s']:.1f} s", flush=True)
  if f.out:
    with open(f.out, "w") as fh:
      json.dump({"step": step, "prompts": prompts, "completions": out.texts,
                 "finished": out.finished, "stats": s}, fh, indent=1)


if __name__ == "__main__":
  cli.run(main, _define_flags)
