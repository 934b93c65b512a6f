r"""Decoding: tokens/s of the dense FFN against the exact sparse one, and the bandwidth ceiling.

    python -m benchmarks.decode --out=decode.json                       # one GPU
    python -m benchmarks.decode --smoke --out=/tmp/decode.json          # CPU, tiny shape

`train.inference.generator.Generator` decodes as `python -m train.generate` does (prefill, then the
token loop inside one compiled program), greedy, `--new_tokens` tokens after prompts of
`--prompts` tokens (validation documents of the offline corpus, one per row), at batch
sizes `--batches`, on weights trained to the paper-like activity (`benchmarks.common.trained`,
cached; 0.5B, and the 1.5B depth by repeating those layers), once with the dense FFN at
every decode step and once with `--sparse` (a `train.generate` decode_ffn value; default
"auto": the few-row sparse kernels of `twell_jax.decode` in the layers where few features
fire in the batch; "sparse": in every layer). The prefill is the same in both (dense), so the decode times compare
the FFNs alone; each is timed on a second call (the first compiles).

The ceiling: a decode step must read every weight of the model once (in the compute dtype:
attention, FFN, norms, the tied embedding as the LM head) and the KV cache up to the
current position; at the device's peak memory bandwidth (`PEAK_GBS` by device kind, else
a device-to-device copy measured here) that bounds tokens/s at batch B by
B x bandwidth / bytes per step (bytes at the mean position of the loop).
`dense_bandwidth_fraction` is the dense decode's tokens/s over that bound.

Exactness: the sparse decode's greedy tokens against the dense FFN's on the same prompts;
where a row parts, the top-2 gap of the logits the dense decode drew its token from at the
first differing position ("top2_gaps": a near-tie is rounding, a large gap a different
function). `exact`: every row equal or parting at a gap of at most `NEAR_TIE`. With
`--profile_dir`, the first batch size's row has each decode's per-token kernel times
("profile": span and largest kernels per token), and the compiled programs' HLO is written
there.

JSON: {"device", "peak_bandwidth_gbs", "rows": [{"shape", "batch", "prompt",
"dense_tokens_per_s", "sparse_tokens_per_s", "ratio", "dense_bandwidth_fraction", "exact",
...}]}.
"""

from __future__ import annotations

import copy
import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks.common import timing
from benchmarks.common import trained

# HBM bandwidth by device kind (vendor specifications), GB/s.
PEAK_GBS = {"NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H200": 4800.0, "NVIDIA H100 PCIe": 2000.0}
_LAYERS = {"0p5b": 8, "1p5b": 28}


def _define_flags():
  flags.DEFINE_list("shapes", ["0p5b", "1p5b"], "0p5b, 1p5b (paper shapes) or tiny (CPU)")
  flags.DEFINE_list("batches", ["1", "4", "16", "64"], "batch sizes")
  flags.DEFINE_list("prompts", ["128", "1024"], "prompt lengths in tokens")
  flags.DEFINE_integer("new_tokens", 256, "tokens decoded per row")
  flags.DEFINE_string("sparse", "auto", "the decode FFN measured against dense "
                      "(a train.generate decode_ffn value: auto, sparse, same)")
  flags.DEFINE_string("decode_attention", "auto", "attention at decode, both decodes (a "
                      "train.generate decode_attention value: auto, kernel, xla)")
  flags.DEFINE_integer("steps", 1500, "training steps of the paper-like weights (cached)")
  flags.DEFINE_string("cache_dir", trained.DEFAULT_CACHE, "where trained weights are kept")
  flags.DEFINE_enum("tokenizer", "byte", ["byte", "python32k"], "corpus and tokenizer of the "
                    "trained weights and the prompts (benchmarks.common.trained.config_for)")
  flags.DEFINE_bool("smoke", False, "CPU smoke mode: tiny shape, short prompts, few tokens")
  flags.DEFINE_string("profile_dir", None, "trace one decode of each FFN at the first batch "
                      "size here; the rows get per-token kernel times (\"profile\")")
  flags.DEFINE_string("out", None, "write the results as JSON here")


def model_bytes(params, mc) -> int:
  """Bytes of the weights one decode step reads: every parameter in the compute dtype
  (inference keeps the RMSNorm scales in their own), the embedding once (tied: the lookup
  reads B rows, the LM head all of it)."""
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  dt = jnp.dtype(model_lib.DTYPES[mc.dtype])
  total = 0
  for path, a in jax.tree_util.tree_leaves_with_path(params):
    is_scale = getattr(path[-1], "key", None) == "scale"
    total += a.size * (a.dtype.itemsize if is_scale else dt.itemsize)
  return int(total)


def kv_bytes(mc, batch: int, positions: float) -> int:
  """Bytes of the KV cache read by one decode step at `positions` cached tokens per row."""
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  head = mc.d_model // mc.n_heads
  itemsize = jnp.dtype(model_lib.DTYPES[mc.dtype]).itemsize
  return int(2 * mc.n_layers * batch * positions * mc.n_kv_heads * head * itemsize)


def measured_copy_gbs(n_bytes: int = 1 << 30) -> float:
  """A device-to-device copy's bandwidth (read + write), GB/s."""
  x = jnp.ones((n_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  jax.block_until_ready(copy(x))
  t0 = time.perf_counter()
  for _ in range(5):
    y = copy(x)
  jax.block_until_ready(y)
  return 2 * x.nbytes * 5 / (time.perf_counter() - t0) / 1e9


def _prompts(cfg, tokenizer, batch: int, length: int) -> list[list[int]]:
  """`batch` prompts of `length` tokens from validation documents (repeated if too few)."""
  from train.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
  source = data_lib.make_source(cfg.data, cfg.data.eval_split)
  out, i = [], 0
  stream = []
  while len(out) < batch:
    stream.extend(int(t) for t in tokenizer.encode(source.get_many([i % len(source)])[0]))
    i += 1
    while len(stream) >= length - 1 and len(out) < batch:
      out.append([int(tokenizer.eos_id)] + stream[:length - 1])
      stream = stream[length - 1:]
  return out


# Where the sparse decode's greedy token differs from the dense one's, the dense model's top
# two logits must be this close (f32 logits of a bf16 model: one bf16 step at magnitudes
# 16-32) for the difference to be rounding, not a different function.
NEAR_TIE = 0.125


def parting(a: list[int], b: list[int]) -> int | None:
  """The first position where two greedy continuations differ (one ending early, at its end
  of sequence, differs there), or None."""
  if a == b:
    return None
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_shape(fl, shape: str, peak_gbs: float) -> list[dict]:
  from train.inference import generator  # pylint: disable=import-outside-toplevel
  from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
  base = "tiny" if shape == "tiny" else "paper_0p5b"
  cfg, params = trained.trained_params(base, "paper", steps=fl.steps, extreme_steps=0,
                                       cache_dir=fl.cache_dir, tokenizer=fl.tokenizer)
  if shape != "tiny":
    n = _LAYERS[shape]
    cfg.model.n_layers = n
    params = trained.repeat_layers(params, n)
  mc = model_lib.ModelConfig.from_config(cfg.model)
  weights = model_bytes(params, mc)
  rows = []
  sparse_cfg = copy.deepcopy(cfg)
  sparse_cfg.model.interpret = bool(fl.smoke)   # the CPU smoke runs the kernels interpreted
  attention = fl.decode_attention if not fl.smoke else "xla"
  gens = {"dense": generator.Generator(params, cfg, prefill_ffn="dense", decode_ffn="dense",
                                      decode_attention=attention),
          fl.sparse: generator.Generator(params, sparse_cfg, prefill_ffn="dense",
                                        decode_ffn=fl.sparse, decode_attention=attention)}
  greedy = generator.Sampling(temperature=0.0)
  for prompt_len in map(int, fl.prompts):
    if prompt_len + fl.new_tokens > cfg.data.seq_len:
      print(f"  {shape}: prompt {prompt_len} + {fl.new_tokens} new tokens exceed the context "
            f"{cfg.data.seq_len}; skipped", flush=True)
      continue
    for batch in map(int, fl.batches):
      prompts = _prompts(cfg, gens["dense"].tokenizer, batch, prompt_len)
      out, profile = {}, {}
      for name, gen in gens.items():
        run = lambda g=gen: g.generate_ids(prompts, max_new_tokens=fl.new_tokens,
                                            sampling=greedy, stop_at_eos=False)
        run()                                                         # compiles
        out[name] = run()
        if fl.profile_dir and not rows:   # the first batch size: per-token kernel times
          trace_dir = os.path.join(fl.profile_dir, f"{shape}_{name}_b{batch}")
          with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run()
          profile[name] = timing.trace_breakdown(trace_dir, fl.new_tokens, top=10)
          for key, (compiled, _) in gen._compiled.items():  # pylint: disable=protected-access
            with open(os.path.join(fl.profile_dir, f"{shape}_{name}_b{batch}_{key[0]}.hlo"),
                      "w") as f:
              f.write(compiled.as_text())
      dense = out["dense"].stats
      step_bytes = weights + kv_bytes(mc, batch, prompt_len + fl.new_tokens / 2)
      ceiling = batch * peak_gbs * 1e9 / step_bytes
      row = {"shape": shape, "batch": batch, "prompt": prompt_len,
             "new_tokens": fl.new_tokens, "weight_bytes": weights,
             "bytes_per_step": step_bytes, "ceiling_tokens_per_s": ceiling,
             "dense_tokens_per_s": dense["decode_tokens_per_s"],
             "dense_ms_per_step": dense["decode_ms_per_step"],
             "dense_bandwidth_fraction": dense["decode_tokens_per_s"] / ceiling,
             "decode_attention": dense["decode_attention"]}
      s = out[fl.sparse].stats
      parted = [(r, i) for r, (ta, tb) in enumerate(zip(out["dense"].tokens,
                                                        out[fl.sparse].tokens))
                if (i := parting(ta, tb)) is not None]
      row.update({
          "sparse_tokens_per_s": s["decode_tokens_per_s"],
          "sparse_ms_per_step": s["decode_ms_per_step"],
          "sparse_layers": s["decode_ffn"],
          "ratio": s["decode_tokens_per_s"] / dense["decode_tokens_per_s"],
          "profile": profile or None,
          "rows_parted": len(parted),
          "top2_gaps": []})
      if parted:   # the dense decode's own logits at the parting tokens (an untimed run)
        gaps = gens["dense"].generate_ids(prompts, max_new_tokens=fl.new_tokens,
                                          sampling=greedy, stop_at_eos=False,
                                          record_gaps=True).top2_gaps
        row["top2_gaps"] = [gaps[r][i] for r, i in parted]
      row["exact"] = all(g <= NEAR_TIE for g in row["top2_gaps"])
      rows.append(row)
      print(f"  {shape:<5} batch {batch:>3} prompt {prompt_len:>5}: dense "
            f"{row['dense_tokens_per_s']:>9,.0f} tok/s ({row['dense_bandwidth_fraction']:.2f} "
            f"of the ceiling {ceiling:,.0f}); {fl.sparse} "
            f"{row['sparse_tokens_per_s']:>9,.0f} ({row['ratio']:.3f}x, layers "
            f"{row['sparse_layers']}), exact {row['exact']}",
            flush=True)
  return rows


def main(argv):
  del argv
  fl = flags.FLAGS
  if fl.smoke:
    fl.shapes, fl.batches, fl.prompts, fl.new_tokens = ["tiny"], ["1", "4"], ["16"], 8
    fl.steps = min(fl.steps, 10)
  device = jax.devices()[0]
  kind = device.device_kind
  peak_gbs = PEAK_GBS.get(kind) or measured_copy_gbs()
  print(f"device: {kind}; peak bandwidth {peak_gbs:,.0f} GB/s", flush=True)
  results = {"device": kind, "peak_bandwidth_gbs": peak_gbs,
             "peak_bandwidth_source": "specification" if kind in PEAK_GBS else "measured copy",
             "new_tokens": fl.new_tokens, "sparse": fl.sparse, "rows": []}
  for shape in fl.shapes:
    results["rows"] += run_shape(fl, shape, peak_gbs)
    if fl.out:
      with open(fl.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
