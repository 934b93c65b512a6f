"""Decoder-only Llama-style language model whose feed-forward blocks are TwELL.

Architecture (one block, pre-norm, no biases anywhere):

  a = x + Attention(RMSNorm(x))          causal, RoPE, grouped-query heads
  y = a + twell_jax.FeedForward(RMSNorm(a))

Shapes: B batch, T sequence, D d_model, H d_ff (FFN hidden width), V vocab,
N query heads, K key/value heads (N % K == 0), E head dim (D = N * E).
Embeddings are tied: logits[B, T, V] = RMSNorm(x_L) @ embedding[V, D]^T (f32).

Two layer layouts (config `scan_layers`):
  * loop (default): params["blocks"][l] holds layer l; the forward pass is a
    Python loop, so compile time grows with depth;
  * scan: params["blocks"] is one block's params with a leading [L] axis on
    every leaf, and the forward pass is `lax.scan` over it: one block is
    compiled once whatever the depth (the paper configs use this). Each step
    of the scan merges the layer's slice into the same Block module, so
    `twell_jax.FeedForward` is used unchanged.
`remat=True` wraps each block in `jax.checkpoint` to bound activation memory.

On a device mesh (`train.runtime.mesh`) every weight is used whole (`twell_jax.sharded.gathered`:
under FSDP, one all-gather per weight at its use) and the FFN runs per device on its tokens
(`twell_jax.sharded.ffn`), so activations stay split over the batch and are never gathered.

The model is used functionally by the trainer: `init_params` returns a plain
nested dict of arrays (what optax and orbax see) and `apply` merges it into
the module inside the traced function.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import twell_jax
from twell_jax import sharded

from train.models import embedding
from train.models import implementations

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
           "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Static model hyper-parameters (converted once from the ConfigDict)."""
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02
  ffn_gated: bool = True
  ffn_activation: str = "relu"
  ffn_implementation: str | None = None
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: bool = False
  scan_layers: bool = False
  # Scan layout: the scan fully unrolled (straight-line layers over the stacked weights).
  # Its loop's stacked residual buffers are then not written with zeros first (XLA copies one
  # zero broadcast into each, every step).
  scan_unroll: bool = False
  attention: str = "auto"   # "xla", "cudnn" (flash attention), "auto": cudnn where it runs
  interpret: bool = False   # FFN kernels in the Mosaic GPU interpreter (CPU; slow)
  # Per-layer FFN implementations (a tuple of L names, None: ffn_implementation for all):
  # set by the trainer's per-layer choice (`train.models.layer_choice`), not by config files.
  ffn_layer_implementations: tuple | None = None
  # Per-layer numbers of hot features (`twell_jax.ffn`'s hot_features: the first K hidden
  # features, the hottest once the features are sorted, run as dense GEMMs in the sparse
  # kernels); None: 0 everywhere. Set with the features' order (`train.models.layer_choice`).
  ffn_layer_hot_features: tuple | None = None

  def __post_init__(self):
    if self.d_model % self.n_heads:
      raise ValueError(f"{self.d_model=} must be divisible by {self.n_heads=}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"{self.n_heads=} must be divisible by {self.n_kv_heads=}")
    if (self.d_model // self.n_heads) % 2:
      raise ValueError("head dim must be even for RoPE")
    for name in ("ffn_layer_implementations", "ffn_layer_hot_features"):
      per_layer = getattr(self, name)
      if per_layer is not None and len(per_layer) != self.n_layers:
        raise ValueError(f"{name} has {len(per_layer)} entries for {self.n_layers} layers")
    if self.attention not in implementations.ATTENTION:
      raise ValueError(f"attention={self.attention!r} not in {implementations.ATTENTION}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(
            f"{name}={getattr(self, name)!r} not in {list(DTYPES)}")

  @classmethod
  def from_config(cls, cfg: Any) -> "ModelConfig":
    d = dict(cfg)
    if d.get("ffn_implementation") in implementations.AUTO:
      d["ffn_implementation"] = None
    return cls(**d)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def layer_ffn(self) -> list[tuple[str | None, int]]:
    """Each layer's (FFN implementation, hot features)."""
    names = self.ffn_layer_implementations or (self.ffn_implementation,) * self.n_layers
    hot = self.ffn_layer_hot_features or (0,) * self.n_layers
    return list(zip(names, hot))

  def layer_groups(self) -> list[tuple[int, int, str | None, int]]:
    """Runs of consecutive layers with one FFN implementation and number of hot features:
    [(start, stop, name, hot_features)]."""
    groups = []
    for l, ffn in enumerate(self.layer_ffn()):
      if groups and groups[-1][2:] == ffn:
        groups[-1] = (groups[-1][0], l + 1, *ffn)
      else:
        groups.append((l, l + 1, *ffn))
    return groups


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, computed in f32."""

  def __init__(self, dim: int, eps: float, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
    return (xf * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, theta: float, positions: jax.Array | None = None) -> jax.Array:
  """Rotary embedding (rotate-half form) of x [B, T, heads, E] at `positions` [B, T] (default
  0..T-1 for every row; the KV-cache decode of `train.generate` passes each row's own)."""
  t, e = x.shape[1], x.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, e, 2, dtype=jnp.float32) / e)  # [E/2]
  pos = (jnp.arange(t, dtype=jnp.float32)[None, :] if positions is None
         else positions.astype(jnp.float32))
  ang = pos[:, :, None] * inv_freq  # [B or 1, T, E/2]
  cos = jnp.cos(ang)[:, :, None, :]
  sin = jnp.sin(ang)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., : e // 2], xf[..., e // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """Causal multi-head attention with K <= N key/value heads (GQA)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(cfg.init_std)
    pd = DTYPES[cfg.param_dtype]
    e = cfg.head_dim
    self.wq = nnx.Param(init(rngs.params(), (cfg.d_model, cfg.n_heads * e), pd))
    self.wk = nnx.Param(
        init(rngs.params(), (cfg.d_model, cfg.n_kv_heads * e), pd))
    self.wv = nnx.Param(
        init(rngs.params(), (cfg.d_model, cfg.n_kv_heads * e), pd))
    self.wo = nnx.Param(init(rngs.params(), (cfg.n_heads * e, cfg.d_model), pd))

  def qkv(self, x, positions=None):
    """(q [B, T, N, E], k [B, T, K, E], v [B, T, K, E]) of x [B, T, D], RoPE at `positions`."""
    cfg, (b, t, d) = self.cfg, x.shape
    dt, e = x.dtype, cfg.head_dim
    w = lambda p: sharded.gathered(p[...].astype(dt))
    # [B * T, D] operands: at one token per row XLA turns a [B, 1, D] x [D, F] product into
    # a broadcast multiply writing [D, F] and a reduction (three passes over the weight);
    # the 2-D product stays one GEMM.
    x2 = x.reshape(b * t, d)
    q = (x2 @ w(self.wq)).reshape(b, t, cfg.n_heads, e)
    k = (x2 @ w(self.wk)).reshape(b, t, cfg.n_kv_heads, e)
    v = (x2 @ w(self.wv)).reshape(b, t, cfg.n_kv_heads, e)
    return rope(q, cfg.rope_theta, positions), rope(k, cfg.rope_theta, positions), v

  def out(self, o):
    """The output projection of the attention result o [B, T, N, E] -> [B, T, D]."""
    b, t = o.shape[:2]
    y = o.reshape(b * t, -1) @ sharded.gathered(self.wo[...].astype(o.dtype))   # 2-D: qkv
    return y.reshape(b, t, -1)

  def __call__(self, x):  # x [B, T, D] in the compute dtype
    q, k, v = self.qkv(x)
    # jax.nn.dot_product_attention handles K < N (GQA) and the causal mask;
    # softmax runs in f32 internally.
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                     implementation=implementations.attention(self.cfg))
    return self.out(o)


class Block(nnx.Module):
  """Pre-norm transformer block; returns (x, FFNStats)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    pd = DTYPES[cfg.param_dtype]
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    self.attn = Attention(cfg, rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    self.ffn = twell_jax.FeedForward(
        cfg.d_model, cfg.d_ff, gated=cfg.ffn_gated,
        activation=cfg.ffn_activation,
        implementation=cfg.ffn_implementation, param_dtype=pd,
        dtype=DTYPES[cfg.dtype], init_std=cfg.init_std, interpret=cfg.interpret, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x))
    y, stats = self.ffn(self.ffn_norm(x), return_stats=True)
    return x + y.astype(x.dtype), stats


class Transformer(nnx.Module):
  """tokens [B, T] int32 -> (logits [B, T, V] f32, per-layer FFNStats).

  With blocks=False it holds only the embedding and the final norm (the scan
  layout keeps the blocks' params outside, see LanguageModel).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, blocks=True):
    self.cfg = cfg
    pd = DTYPES[cfg.param_dtype]
    self.embed = nnx.Param(
        nnx.initializers.normal(cfg.init_std)(
            rngs.params(), (cfg.vocab_size, cfg.d_model), pd))
    if blocks:
      self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)

  def embed_tokens(self, tokens):
    table = sharded.gathered(self.embed[...].astype(DTYPES[self.cfg.dtype]))
    return embedding.lookup(table, tokens)

  def logits(self, x):
    """logits [B, T, V] f32 of the final hidden state x (normalized here): a compute-dtype
    GEMM with f32 accumulation. Training never forms them (`train.models.losses`)."""
    x = self.final_norm(x)
    return jnp.einsum("btd,vd->btv", x, sharded.gathered(self.embed[...].astype(x.dtype)),
                      preferred_element_type=jnp.float32)

  def features(self, tokens):
    """(final hidden state [B, T, D] before the final norm, per-layer FFNStats)."""
    x = self.embed_tokens(tokens)
    all_stats = []
    for block, (name, hot) in zip(self.blocks, self.cfg.layer_ffn()):
      block.ffn.implementation, block.ffn.hot_features = name, hot
      if self.cfg.remat:
        x, stats = nnx.remat(lambda blk, h: blk(h))(block, x)
      else:
        x, stats = block(x)
      all_stats.append(stats)
    # Stack per-layer stats: every FFNStats leaf gains a leading [L] axis.
    return x, twell_jax.stats.stack(all_stats)

  def __call__(self, tokens):
    x, stacked = self.features(tokens)
    return self.logits(x), stacked


def _merge(graphdef, template, params: dict):
  state = jax.tree.map(lambda v: v, template)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


class LanguageModel:
  """Functional wrapper: pure-dict params in, (logits, stats) out."""

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg
    scan = cfg.scan_layers
    abstract = nnx.eval_shape(
        lambda: Transformer(cfg, nnx.Rngs(0), blocks=not scan))
    self._graphdef, self._template = nnx.split(abstract)
    if scan:
      block = nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0)))
      self._block_graphdef, self._block_template = nnx.split(block)

  def init_params(self, key: jax.Array) -> dict:
    """Random parameters as a nested dict of arrays (keys follow the module)."""
    cfg = self.cfg
    if not cfg.scan_layers:
      model = Transformer(cfg, nnx.Rngs(params=key))
      return nnx.to_pure_dict(nnx.state(model, nnx.Param))
    outer_key, blocks_key = jax.random.split(key)
    outer = Transformer(cfg, nnx.Rngs(params=outer_key), blocks=False)
    params = nnx.to_pure_dict(nnx.state(outer, nnx.Param))

    def one_block(k):
      return nnx.to_pure_dict(
          nnx.state(Block(cfg, nnx.Rngs(params=k)), nnx.Param))

    params["blocks"] = jax.vmap(one_block)(
        jax.random.split(blocks_key, cfg.n_layers))
    return params

  def outer_module(self, params: dict) -> Transformer:
    """The embedding and final norm of `params` as a Transformer without blocks (scan layout:
    the blocks' params, if present, are left out)."""
    if not self.cfg.scan_layers:
      raise ValueError("outer_module() needs scan_layers=True")
    return _merge(self._graphdef, self._template,
                  {k: v for k, v in params.items() if k != "blocks"})

  def block_module(self, block_params: dict) -> Block:
    """One Block module holding one layer's params (scan layout)."""
    if not self.cfg.scan_layers:
      raise ValueError("block_module() needs scan_layers=True")
    return _merge(self._block_graphdef, self._block_template, block_params)

  def bind(self, params: dict) -> Transformer:
    """The Transformer module (loop layout only)."""
    if self.cfg.scan_layers:
      raise ValueError("bind() needs scan_layers=False; use apply()")
    return _merge(self._graphdef, self._template, params)

  def _features(self, params: dict, tokens: jax.Array):
    """(outer Transformer module, final hidden state before the final norm, stats)."""
    if not self.cfg.scan_layers:
      model = self.bind(params)
      return (model, *model.features(tokens))
    outer_params = {k: v for k, v in params.items() if k != "blocks"}
    outer = _merge(self._graphdef, self._template, outer_params)
    x, group_stats = outer.embed_tokens(tokens), []
    # One scan per run of layers with the same FFN implementation (a static choice).
    for start, stop, name, hot in self.cfg.layer_groups():
      def layer(x, block_params, name=name, hot=hot):
        block = _merge(self._block_graphdef, self._block_template,
                       block_params)
        block.ffn.implementation, block.ffn.hot_features = name, hot
        return block(x)

      if self.cfg.remat:
        layer = jax.checkpoint(layer)
      group = jax.tree.map(lambda a, s=start, e=stop: a[s:e], params["blocks"])
      x, stats = jax.lax.scan(layer, x, group, unroll=bool(self.cfg.scan_unroll) or 1)
      group_stats.append(stats)
    stats = twell_jax.stats.stack(group_stats, concatenate=True)
    return outer, x, stats

  def apply(self, params: dict, tokens: jax.Array):
    """(logits [B, T, V] f32, per-layer FFNStats)."""
    outer, x, stats = self._features(params, tokens)
    return outer.logits(x), stats

  def hidden(self, params: dict, tokens: jax.Array):
    """(normalized final hidden state [B, T, D] in the compute dtype, per-layer FFNStats):
    what the tied LM head multiplies by `params["embed"]` (see `train.models.losses`)."""
    outer, x, stats = self._features(params, tokens)
    return outer.final_norm(x), stats

  def ffn_inputs(self, params: dict, tokens: jax.Array) -> jax.Array:
    """Each layer's FFN input (the normalized residual stream) [L, B, T, D] for `tokens`.

    Runs the same forward pass as `apply` (the FFNs included, so layer l + 1 sees what it
    sees in training) and returns what each block's FFN was called on.
    """
    def layer(x, block):
      a = x + block.attn(block.attn_norm(x))
      f_in = block.ffn_norm(a)
      y, _ = block.ffn(f_in, return_stats=True)
      return a + y.astype(a.dtype), f_in

    if not self.cfg.scan_layers:
      model = self.bind(params)
      x, outs = model.embed_tokens(tokens), []
      for block in model.blocks:
        x, f_in = layer(x, block)
        outs.append(f_in)
      return jnp.stack(outs)
    outer = _merge(self._graphdef, self._template,
                   {k: v for k, v in params.items() if k != "blocks"})

    def step(x, block_params):
      return layer(x, _merge(self._block_graphdef, self._block_template, block_params))

    _, outs = jax.lax.scan(step, outer.embed_tokens(tokens), params["blocks"])
    return outs


def stacked_ffn(params: dict, n_layers: int) -> dict:
  """Layer FFN weights as {name: [L, ...]} for either layout."""
  blocks = params["blocks"]
  if "ffn" in blocks:  # scan layout: already stacked
    return dict(blocks["ffn"])
  names = blocks[0]["ffn"].keys()
  return {n: jnp.stack([blocks[l]["ffn"][n] for l in range(n_layers)])
          for n in names}


def stacked_blocks(params: dict, n_layers: int) -> dict:
  """Every block parameter with a leading [L] axis (the scan layout's `params["blocks"]`),
  from either layout."""
  blocks = params["blocks"]
  if "ffn" in blocks:  # scan layout: already stacked
    return blocks
  return jax.tree.map(lambda *a: jnp.stack(a), *[blocks[l] for l in range(n_layers)])


def unstacked_blocks(blocks: dict, n_layers: int) -> list[dict]:
  """Layer l's slice of every stacked block parameter (the scan layout's `params["blocks"]`),
  for l < n_layers: the inverse of `stacked_blocks`."""
  return [jax.tree.map(lambda a, l=l: a[l], blocks) for l in range(n_layers)]


def with_stacked_ffn(params: dict, ffn: dict) -> dict:
  """Inverse of stacked_ffn: params with FFN weights replaced by `ffn`."""
  blocks = params["blocks"]
  if "ffn" in blocks:
    return {**params, "blocks": {**blocks, "ffn": {**blocks["ffn"], **ffn}}}
  new_blocks = {
      l: {**blocks[l], "ffn": {**blocks[l]["ffn"],
                               **{n: w[i] for n, w in ffn.items()}}}
      for i, l in enumerate(sorted(blocks))}
  return {**params, "blocks": new_blocks}


def permute_ffn_features(tree, order):
  """`tree` (params, or anything holding params-shaped subtrees such as an optimizer state)
  with every FFN weight's hidden features in `order` [L, H] (`twell_jax.sort_features`'s
  order, per layer): the model computes the same function with the permuted params (up to
  the order of its sums), and an optimizer state permuted alike stays matched to them."""
  def one(path, leaf):
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if len(keys) < 2 or keys[-2] != "ffn" or keys[-1] not in ("w_gate", "w_up", "w_down"):
      return leaf
    i = keys.index("blocks") if "blocks" in keys else None
    # Loop layout: the layer index follows "blocks"; scan layout: a leading [L] axis.
    layer_order = order if keys[i + 1] == "ffn" else order[int(keys[i + 1])]
    if keys[-1] == "w_down":
      return twell_jax.permute_features(None, None, leaf, layer_order)[2]
    return twell_jax.permute_features(leaf, None, None, layer_order)[0]
  return jax.tree_util.tree_map_with_path(one, tree)


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
