r"""Text generation from a checkpoint with a KV cache (the library of `train.generate`).

  ck = train.inference.loading.load_checkpoint(W)
  out = train.inference.generator.generate(ck.params, ck.config, ["def add(a, b):"],
                                           max_new_tokens=32)
  out.texts, out.stats

Two compiled functions, shapes static:
  * prefill: the prompts, right-padded to a common length (a multiple of 64), run through
    the model in one call, as in training, and fill the KV cache [L, B, T_max, K, E] with
    their keys and values (T_max = padded prompt length + max_new_tokens). Each prompt's
    next-token logits are read at its own last position, and causal attention keeps the
    padding out of every real token's view.
  * decode: a `lax.while_loop` over the new tokens, one token per row and step: the row's
    key and value are written at its position (its prompt length plus the step), and its
    query attends to its cache prefix. It stops after max_new_tokens or once every row has
    emitted EOS (unless `stop_at_eos=False`).
A third, `score_ids`, runs the prefill's forward pass on given rows and returns each
position's log-probability of a given next token (lm-evaluation-harness's loglikelihood:
`train.inference.lm_eval_backend`).
Sampling: temperature (0: greedy), top-k (0: off) and top-p (nucleus; 1: off), from one
seed (step i samples with `fold_in(key(seed), i)`).

Which FFN and attention run where is the plan of `train.models.implementations` (`Plan`).
Prefill calls each FFN on B x T tokens, where the sparse kernels beat the dense FFN for layers
that fire few enough features: `prefill_ffn="auto"` takes the per-layer choice for inference
from the checkpoint's logged activity where the sparse implementation runs here (a Hopper
GPU); elsewhere every layer runs dense. Decode calls each FFN on B tokens (one per row), where
the dense FFN streams W_gate, W_up and W_down for a few rows: `decode_ffn="auto"` (the
default) runs a layer on the few-row sparse kernels (`twell_jax.decode`: W_gate, then only the
W_up and W_down rows of the features that fire in some row) where few enough features are
expected to fire in some row of the batch, from the layer's activity (logged, else measured by
the prefill), and the kernels run here (a GPU, or `model.interpret`); "sparse" runs them in
every layer, "dense" none, "same" the prefill's per-layer choice.

Prompts start with the tokenizer's EOS id (`prefix_eos`): in the packed training stream a
document follows the EOS of the one before, so this is how the model saw a document begin.
A prompt plus max_new_tokens longer than the training context (data.seq_len) is refused
(`ConfigError`) rather than silently run past what the model was trained on; by default
max_new_tokens fills the context after the longest prompt (at most 128).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from train.data import tokenizer as tokenizer_lib
from train.inference import loading
from train.models import implementations
from train.models import transformer as model_lib
from train import errors

PROMPT_BUCKET = 64     # prompts are padded to a multiple of this (fewer recompiles)
DEFAULT_MAX_NEW_TOKENS = 128
SCORE_LOGITS_TOKENS = 8192   # positions whose logits `score_ids` forms at once


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn from the logits."""
  temperature: float = 0.8   # 0: greedy (argmax)
  top_k: int = 0             # keep the k most likely tokens; 0: all
  top_p: float = 1.0         # keep the smallest set whose probability reaches p; 1: all

  def __post_init__(self):
    if self.temperature < 0:
      raise errors.ConfigError(f"temperature must be >= 0; got {self.temperature}")
    if self.top_k < 0:
      raise errors.ConfigError(f"top_k must be >= 0; got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise errors.ConfigError(f"top_p must be in (0, 1]; got {self.top_p}")


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
  """Next tokens [B] int32 from logits [B, V] f32."""
  if s.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / s.temperature
  if 0 < s.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if s.top_p < 1.0:
    desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    # A token stays if the mass of the more likely ones is below top_p (the first always does).
    keep = jnp.cumsum(probs, axis=-1) - probs < s.top_p
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class Generation:
  """What one `Generator` call returns."""
  tokens: list[list[int]]    # new tokens of each prompt, up to (without) its EOS
  finished: list[bool]       # the row emitted EOS
  texts: list[str] | None    # the decoded completions (text calls)
  stats: dict                # timings, tokens/s and the FFN implementations used
  # With record_gaps: per row, for each new token, the gap between the two largest logits it
  # was drawn from (how near a tie the choice was).
  top2_gaps: list[list[float]] | None = None


def _split_at_eos(out: np.ndarray, eos: int) -> tuple[list[list[int]], list[bool]]:
  """Each row of `out` [B, steps] up to (without) its first EOS, and whether it has one."""
  new_tokens, finished = [], []
  for row in out:
    hit = np.flatnonzero(row == eos)
    finished.append(bool(hit.size))
    new_tokens.append([int(t) for t in (row[:hit[0]] if hit.size else row)])
  return new_tokens, finished


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


class Generator:
  """Compiled prefill + decode for one model; keeps its executables between calls.

  Args:
    params: the model parameters, either layer layout.
    config: the training ConfigDict (model, data: tokenizer and context length), e.g.
      `train.inference.loading.load_checkpoint(W).config`.
    tokenizer: overrides the one the config names.
    prefill_ffn: "auto" (see the module docstring), an implementation name for every layer,
      or a sequence of L names.
    active_per_token: [L] measured activity for "auto"; None: taken from the first call's
      own prefill, which then runs dense.
    decode_ffn: "auto", "dense", "sparse" (every layer) or "same" (the prefill's choice);
      see the module docstring.
    decode_attention: "auto", "kernel" or "xla" (`train.models.implementations.DECODE_ATTENTION`).
    dtype: compute in this dtype instead of the config's `model.dtype`.
  """

  def __init__(self, params: dict, config: Any, *, tokenizer=None,
               prefill_ffn: str | Sequence[str] = "auto",
               active_per_token: Sequence[float] | None = None, decode_ffn: str = "auto",
               decode_attention: str = "auto", dtype: str | None = None):
    try:
      mc = model_lib.ModelConfig.from_config(config.model)
      if dtype is not None:
        mc = dataclasses.replace(mc, dtype=dtype)
    except (TypeError, ValueError) as e:  # bad or unknown model fields
      raise errors.ConfigError(f"config.model: {e}") from e
    self.model_cfg = dataclasses.replace(mc, remat=False)
    self.context = int(config.data.seq_len)
    self.tokenizer = tokenizer or tokenizer_lib.make_tokenizer(config.data)
    if self.tokenizer.vocab_size > mc.vocab_size:
      raise errors.ConfigError(
          f"the tokenizer has {self.tokenizer.vocab_size} ids, more than the model's "
          f"vocab_size {mc.vocab_size}: not the tokenizer this model was trained with")
    self.params = loading.inference_params(params, mc)
    self._lm = model_lib.LanguageModel(dataclasses.replace(
        self.model_cfg, scan_layers=True, ffn_layer_implementations=None))
    self.plan = implementations.Plan(self.model_cfg, prefill_ffn=prefill_ffn,
                              active_per_token=active_per_token, decode_ffn=decode_ffn,
                              decode_attention=decode_attention)
    self._compiled: dict[tuple, Any] = {}
    self._layers = None
    self._ffn_param_names = tuple(self.params["blocks"]["ffn"])

  def _groups(self, names):
    """[(start, stop, name, hot features)]: runs of layers with one implementation and one
    number of hot features (one scan each)."""
    return dataclasses.replace(self.model_cfg, ffn_layer_implementations=tuple(names)
                               ).layer_groups()

  def _layer_params(self, names: Sequence[str]) -> list:
    """The blocks' parameters split into one array per layer, for decode (kept beside the
    stacked ones, which prefill scans over: the blocks' weights twice in device memory).
    The FFN of a layer that decodes sparse ("decode") is held in the kernels' layout
    (`twell_jax.decode.DecodeWeights`: W_up transposed)."""
    from twell_jax import decode  # pylint: disable=import-outside-toplevel
    sparse = tuple(l for l, name in enumerate(names) if name == "decode")
    if self._layers is None or self._layers[0] != sparse:
      def split(blocks):
        layers = model_lib.unstacked_blocks(blocks, len(names))
        for l in sparse:
          f = layers[l]["ffn"]
          layers[l] = {**layers[l], "ffn": decode.DecodeWeights.of(
              f.get("w_gate"), f["w_up"], f["w_down"])}
        return layers
      self._layers = None   # the old copy goes before the new one is made
      self._layers = (sparse, jax.jit(split)(self.params["blocks"]))
    return self._layers[1]

  # ---- the compiled functions ----

  def _forward(self, params, tokens, *, names, keep_cache: bool):
    """(final hidden state [B, T, D] before the final norm, cache k, v [L, B, T, K, E] (None
    without `keep_cache`), active [L]): the model on `tokens` [B, T], the FFN of layer l
    running `names[l]`, causal attention as in training."""
    lm = self._lm
    attention = implementations.attention(self.model_cfg)

    def layer(x, block_params, name, hot):
      block = lm.block_module(block_params)
      block.ffn.implementation, block.ffn.hot_features = name, hot
      q, k, v = block.attn.qkv(block.attn_norm(x))
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
      x = x + block.attn.out(o)
      y, stats = block.ffn(block.ffn_norm(x), return_stats=True)
      cache = (k, v) if keep_cache else ()
      return x + y.astype(x.dtype), (*cache, stats.nnz_per_token)

    x, outs = lm.outer_module(params).embed_tokens(tokens), []
    for start, stop, name, hot in self._groups(names):
      group = jax.tree.map(lambda a, s=start, e=stop: a[s:e], params["blocks"])
      x, ys = jax.lax.scan(functools.partial(layer, name=name, hot=hot), x, group)
      outs.append(ys)
    per_layer = [jnp.concatenate(a) for a in zip(*outs)]
    if keep_cache:
      return x, per_layer[0], per_layer[1], per_layer[2]
    return x, None, None, per_layer[0]

  def _prefill_fn(self, params, tokens, lengths, *, names, t_max):
    """(next-token logits [B, V] f32, cache k, v [L, B, t_max, K, E], active [L])."""
    x, ks, vs, active = self._forward(params, tokens, names=names, keep_cache=True)
    last = x[jnp.arange(x.shape[0]), lengths - 1]                     # [B, D]
    logits = self._lm.outer_module(params).logits(last[:, None])[:, 0]
    pad = ((0, 0), (0, 0), (0, t_max - tokens.shape[1]), (0, 0), (0, 0))
    return logits, jnp.pad(ks, pad), jnp.pad(vs, pad), active

  def _score_fn(self, params, tokens, targets, *, names):
    """(log p(targets[b, t] | tokens[b, :t + 1]) [B, T] f32, whether targets[b, t] is the
    most likely token [B, T] bool, active [L]).

    The logits are formed a few rows at a time (`SCORE_LOGITS_TOKENS` positions): all of
    them at once, [B, T, V] f32, would be gigabytes at a 32k vocabulary and long rows."""
    x, _, _, active = self._forward(params, tokens, names=names, keep_cache=False)
    outer = self._lm.outer_module(params)

    def one_row(row):
      x_row, target = row                                             # [T, D], [T]
      logits = outer.logits(x_row[None])[0]                           # [T, V] f32
      logprobs = jax.nn.log_softmax(logits, axis=-1)
      picked = jnp.take_along_axis(logprobs, target[:, None], axis=-1)[:, 0]
      return picked, jnp.argmax(logits, axis=-1) == target

    rows = max(1, SCORE_LOGITS_TOKENS // tokens.shape[1])
    logprobs, greedy = jax.lax.map(one_row, (x, targets), batch_size=rows)
    return logprobs, greedy, active

  def _decode_fn(self, params, layers, logits, ck, cv, lengths, key, *, names, steps,
                 sampling, eos_id, pad_id, stop_at_eos, record_gaps=False):
    """(tokens [B, steps] int32 (pad_id after a row's EOS), decode steps run, and with
    `record_gaps` the top-2 logit gap [B, steps] f32 each token was drawn with, else None).

    `layers`: the blocks' parameters one array per layer (`_layer_params`), and the KV cache
    one array per layer in the loop: each step reads every weight where it lies (XLA copies
    a layer's slice of the stacked arrays inside the token loop every step: three times
    the bytes a step must read)."""
    outer = self._lm.outer_module(params)
    # One row runs as two equal ones: XLA rewrites a [1, D] x [D, F] product whose operands
    # hold under 10M elements as a broadcast multiply writing [D, F] and a reduction, three
    # passes over the weight; with two rows every projection stays one GEMM.
    single = logits.shape[0] == 1
    if single:
      logits, lengths = jnp.concatenate([logits, logits]), jnp.concatenate([lengths, lengths])
      ck, cv = jnp.concatenate([ck, ck], axis=1), jnp.concatenate([cv, cv], axis=1)
    rows = jnp.arange(logits.shape[0])
    per_layer = [(name, hot) for start, stop, name, hot in self._groups(names)
                 for _ in range(start, stop)]
    ck, cv = tuple(ck[l] for l in range(len(layers))), tuple(cv[l] for l in range(len(layers)))

    def forward(tok, pos, ck, cv):
      x, ck, cv = outer.embed_tokens(tok[:, None]), list(ck), list(cv)
      for l, (block_params, (name, hot)) in enumerate(zip(layers, per_layer)):
        x, ck[l], cv[l] = self._decode_layer(x, block_params, name, hot, pos, ck[l], cv[l],
                                             rows, single)
      return outer.logits(x)[:, 0], tuple(ck), tuple(cv)

    def draw(logits, i):
      tok = sample(logits, jax.random.fold_in(key, i), sampling)
      return jnp.broadcast_to(tok[:1], tok.shape) if single else tok   # the copy follows

    def top2_gap(logits):
      top = jax.lax.top_k(logits.astype(jnp.float32), 2)[0]
      return top[:, 0] - top[:, 1]

    tok = draw(logits, 0)
    out = jnp.full((logits.shape[0], steps), pad_id, jnp.int32).at[:, 0].set(tok)
    # Only when asked: a top-k over the vocabulary per step is not free.
    gaps = (jnp.zeros((logits.shape[0], steps), jnp.float32).at[:, 0].set(top2_gap(logits))
            if record_gaps else None)
    done = tok == eos_id

    def cond(state):
      i, done = state[0], state[-1]
      going = i < steps
      return going & ~jnp.all(done) if stop_at_eos else going

    def body(state):
      i, tok, ck, cv, out, gaps, done = state
      # Token i - 1 sits at position length + i - 1; its logits give token i.
      logits, ck, cv = forward(tok, lengths + i - 1, ck, cv)
      nxt = jnp.where(done, pad_id, draw(logits, i))
      if record_gaps:
        gaps = gaps.at[:, i].set(top2_gap(logits))
      return (i + 1, nxt, ck, cv, out.at[:, i].set(nxt), gaps, done | (nxt == eos_id))

    state = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, ck, cv, out, gaps, done))
    one = lambda a: a[:1] if single and a is not None else a
    return one(state[4]), state[0] - 1, one(state[5])

  def _decode_layer(self, x, block_params, name, hot, pos, k_cache, v_cache, rows, single):
    """One layer of a decode step on x [B, 1, D] at positions `pos` [B]: (x, k_cache,
    v_cache) after it. A layer that decodes sparse ("decode") holds its FFN in the kernels'
    layout (`_layer_params`); the block module never calls its own FFN there, whose weights
    are only placeholders."""
    from pallas_kernels import decode_attention_triton  # pylint: disable=import-outside-toplevel
    from twell_jax import decode  # pylint: disable=import-outside-toplevel
    cfg, sparse = self.model_cfg, name == "decode"
    if sparse:
      w = block_params["ffn"]
      block_params = {**block_params, "ffn": {k: w.w_down for k in self._ffn_param_names}}
    block = self._lm.block_module(block_params)
    block.ffn.implementation, block.ffn.hot_features = name, hot
    q, k, v = block.attn.qkv(block.attn_norm(x), pos[:, None])
    if self.plan.decode_attention == "kernel":
      o, k_cache, v_cache = decode_attention_triton.decode_attention(
          q[:, 0], k[:, 0], v[:, 0], k_cache, v_cache, pos, interpret=bool(cfg.interpret))
      o = o[:, None]
    else:
      k_cache = k_cache.at[rows, pos].set(k[:, 0])
      v_cache = v_cache.at[rows, pos].set(v[:, 0])
      o = jax.nn.dot_product_attention(q, k_cache, v_cache, key_value_seq_lengths=pos + 1,
                                       implementation="xla")
    x = x + block.attn.out(o)
    if sparse:
      xn = block.ffn_norm(x)[:, 0].astype(model_lib.DTYPES[cfg.dtype])
      # One row's two equal copies: the decode FFN runs on one (its one-row kernel).
      y = decode.decode_ffn_weights(xn[:1] if single else xn, w,
                                    interpret=bool(cfg.interpret))[0]
      y = jnp.broadcast_to(y, xn.shape)[:, None]
    else:
      y = block.ffn(block.ffn_norm(x))
    return x + y.astype(x.dtype), k_cache, v_cache

  def _compile(self, kind: str, fn, args, **static):
    key = (kind, tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args[1:])),
           tuple(sorted(static.items())))
    if key not in self._compiled:
      t0 = time.perf_counter()
      self._compiled[key] = (jax.jit(functools.partial(fn, **static)).lower(*args).compile(),
                             time.perf_counter() - t0)
    return self._compiled[key]

  # ---- calls ----

  def _checked_lengths(self, prompts, max_new_tokens):
    """(the prompts' lengths [B] int32, max_new_tokens filled in): ConfigError for no prompt,
    an empty one, or a prompt plus max_new_tokens past the trained context."""
    if not prompts:
      raise errors.ConfigError("no prompts")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
      raise errors.ConfigError("every prompt needs at least one token (an empty text "
                               "prompt with prefix_eos=True has one)")
    longest = int(lengths.max())
    if longest >= self.context:
      raise errors.ConfigError(
          f"a prompt of {longest} tokens leaves no room in the context of {self.context} "
          "tokens this model was trained on (data.seq_len); shorten the prompt")
    if max_new_tokens is None:
      max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, self.context - longest)
    if max_new_tokens < 1:
      raise errors.ConfigError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if longest + max_new_tokens > self.context:
      raise errors.ConfigError(
          f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
          f"context of {self.context} tokens this model was trained on (data.seq_len); "
          "shorten the prompt or lower max_new_tokens")
    return lengths, max_new_tokens

  def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None,
                   sampling: Sampling = Sampling(), seed: int = 0,
                   stop_at_eos: bool = True, record_gaps: bool = False) -> Generation:
    """Completes token-id prompts (each non-empty); see the module docstring.

    max_new_tokens: None fills the context after the longest prompt, at most
    `DEFAULT_MAX_NEW_TOKENS`. record_gaps: also return each new token's top-2 logit gap
    (`Generation.top2_gaps`; the decode loop then does a top-k per step, so time it without).
    """
    lengths, max_new_tokens = self._checked_lengths(prompts, max_new_tokens)
    longest = int(lengths.max())
    t_pad = min(_round_up(longest, PROMPT_BUCKET), self.context)
    batch = np.zeros((len(prompts), t_pad), np.int32)
    for i, p in enumerate(prompts):
      batch[i, :len(p)] = p
    tokens, lens = jnp.asarray(batch), jnp.asarray(lengths)

    names = self.plan.prefill_implementations(batch.size)
    measured = names is None
    run_names = ("dense",) * self.model_cfg.n_layers if measured else names
    prefill, prefill_compile_s = self._compile(
        "prefill", self._prefill_fn, (self.params, tokens, lens), names=run_names,
        t_max=t_pad + max_new_tokens)
    t0 = time.perf_counter()
    logits, ck, cv, active = jax.block_until_ready(prefill(self.params, tokens, lens))
    prefill_s = time.perf_counter() - t0
    if measured:
      self.plan.active_per_token = [float(a) for a in np.asarray(active)]
      names = self.plan.prefill_implementations(batch.size)

    activity = self.plan.active_per_token or [float(a) for a in np.asarray(active)]
    decode_names = self.plan.decode_implementations(len(prompts), names or run_names, activity)
    key = jax.random.key(seed)
    outer_params = {k: v for k, v in self.params.items() if k != "blocks"}
    args = (outer_params, self._layer_params(decode_names), logits, ck, cv, lens, key)
    decode, decode_compile_s = self._compile(
        "decode", self._decode_fn, args,
        names=decode_names, steps=max_new_tokens, sampling=sampling,
        eos_id=int(self.tokenizer.eos_id), pad_id=tokenizer_lib.PAD_ID, stop_at_eos=stop_at_eos,
        record_gaps=record_gaps)
    t0 = time.perf_counter()
    out, steps, gaps = jax.block_until_ready(decode(*args))
    decode_s = time.perf_counter() - t0
    out, steps = np.asarray(out), int(steps)

    new_tokens, finished = _split_at_eos(out, int(self.tokenizer.eos_id))
    b = len(prompts)
    describe = lambda ns: "".join("D" if n == "dense" else "S" for n in ns)
    stats = {
        "device": jax.devices()[0].device_kind, "batch": b, "prompt_tokens_padded": t_pad,
        "prefill_s": prefill_s, "prefill_tokens_per_s": b * t_pad / prefill_s,
        "decode_steps": steps, "decode_s": decode_s,
        "decode_tokens_per_s": b * steps / decode_s if steps else 0.0,
        "decode_ms_per_step": 1e3 * decode_s / steps if steps else 0.0,
        "compile_s": prefill_compile_s + decode_compile_s,
        "prefill_ffn": describe(run_names), "decode_ffn": describe(decode_names),
        "decode_attention": self.plan.decode_attention,
        "ffn_implementations": sorted(set(run_names) | set(decode_names)),
        "prefill_active_per_token": [float(a) for a in np.asarray(active)],
    }
    top2_gaps = None
    if gaps is not None:
      # a finished row's EOS token included
      top2_gaps = [[float(g) for g in row[:len(t) + f]]
                   for row, t, f in zip(np.asarray(gaps), new_tokens, finished)]
    return Generation(tokens=new_tokens, finished=finished, texts=None, stats=stats,
                      top2_gaps=top2_gaps)

  def score_ids(self, tokens: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                        dict]:
    """Scores `targets` [B, T] int32 after `tokens` [B, T] int32 in one prefill-like call:
    (log p(targets[b, t] | tokens[b, :t + 1]) [B, T] f32, whether each target is the argmax
    [B, T] bool, stats). Rows are causal, so right padding changes no real position.

    The FFNs run what a prefill of B x T tokens runs (`Plan.prefill_implementations`; with
    "auto" and no activity known yet, this call runs dense and measures it). Keep B and T to
    a few shapes: each new one compiles. stats: "seconds" (the call, not the compile),
    "compile_s" (0 when this shape was compiled before), "ffn" (D/S per layer).
    """
    b, t = tokens.shape
    if targets.shape != (b, t):
      raise errors.ConfigError(f"targets {targets.shape} must have the shape of tokens {(b, t)}")
    if t > self.context:
      raise errors.ConfigError(
          f"rows of {t} tokens exceed the context of {self.context} tokens this model was "
          "trained on (data.seq_len)")
    names = self.plan.prefill_implementations(tokens.size)
    measured = names is None
    run_names = ("dense",) * self.model_cfg.n_layers if measured else names
    args = (self.params, jnp.asarray(tokens, jnp.int32), jnp.asarray(targets, jnp.int32))
    known = len(self._compiled)
    score, compile_s = self._compile("score", self._score_fn, args, names=run_names)
    t0 = time.perf_counter()
    logprobs, greedy, active = jax.block_until_ready(score(*args))
    seconds = time.perf_counter() - t0
    if measured:
      self.plan.active_per_token = [float(a) for a in np.asarray(active)]
    stats = {"seconds": seconds, "compile_s": compile_s if len(self._compiled) > known else 0.0,
             "ffn": "".join("D" if n == "dense" else "S" for n in run_names)}
    return np.asarray(logprobs), np.asarray(greedy), stats

  def __call__(self, prompts: Sequence[str], *, prefix_eos: bool = True, **kwargs) -> Generation:
    """Completes text prompts; kwargs are `generate_ids`'s."""
    prefix = [int(self.tokenizer.eos_id)] if prefix_eos else []
    ids = [prefix + [int(t) for t in self.tokenizer.encode(p)] for p in prompts]
    out = self.generate_ids(ids, **kwargs)
    out.texts = [self.tokenizer.decode(t) for t in out.tokens]
    return out


def generate(params: dict, config: Any, prompts: Sequence[str], *,
             max_new_tokens: int | None = None,
             temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_at_eos: bool = True, prefix_eos: bool = True, **generator_kwargs
             ) -> Generation:
  """Completes `prompts` with the model `params` of the training config `config`.

  `generator_kwargs` go to `Generator` (tokenizer, prefill_ffn, active_per_token,
  decode_ffn). Keep a `Generator` instead to reuse its compiled functions across calls.
  """
  gen = Generator(params, config, **generator_kwargs)
  return gen(prompts, max_new_tokens=max_new_tokens, prefix_eos=prefix_eos,
             sampling=Sampling(temperature, top_k, top_p), seed=seed,
             stop_at_eos=stop_at_eos)


def from_checkpoint(ck: loading.Checkpoint, workdir: str, **generator_kwargs) -> Generator:
  """A `Generator` (`generator_kwargs`: its arguments) for the restored checkpoint `ck` of
  `workdir`, with the activity training logged for prefill_ffn="auto"."""
  active = logged_activity(workdir, ck.step, ck.model_cfg.n_layers)
  return Generator(ck.params, ck.config, tokenizer=ck.tokenizer, active_per_token=active,
                   **generator_kwargs)


def from_workdir(workdir: str, step: int | None = None, **kwargs) -> tuple[Generator, int]:
  """(`from_checkpoint` of checkpoint `step` (default: the latest) of `workdir`, its step)."""
  ck = loading.load_checkpoint(workdir, step)
  return from_checkpoint(ck, workdir, **kwargs), ck.step


def logged_activity(workdir: str, step: int, n_layers: int) -> list[float] | None:
  """The activity per layer logged by training at or before `step`: the held-out eval's if
  one was logged, else the last training interval's; None if the run logged none."""
  from train.runtime import metrics  # pylint: disable=import-outside-toplevel
  rows = [r for r in metrics.read_jsonl(workdir) if r.get("step", 0) <= step]
  for prefix in ("eval/active_per_token", "active_per_token"):
    keys = [f"{prefix}/layer_{l}" for l in range(n_layers)]
    found = [r for r in rows if all(k in r for k in keys)]
    if found:
      return [float(found[-1][k]) for k in keys]
  return None
