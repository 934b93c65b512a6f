"""The Hugging Face Llama format of the model: tensor names, config.json and tokenizer files.

The model (`train/models/transformer.py`) is a Llama: pre-norm RMSNorm blocks, RoPE, grouped-query
attention, a gated FFN, no biases. Only the gate's activation differs (ReLU for the sparse
model: `hidden_act: "relu"`, which transformers' Llama runs as is) and the embedding is tied
(`tie_word_embeddings: true`). Tensors, for layer l (loop layout `params["blocks"][l]`; the
scan layout has a leading [L] axis instead):

  ours                      shape      Hugging Face                                   shape
  embed                     [V, D]     model.embed_tokens.weight                      [V, D]
  final_norm.scale          [D]        model.norm.weight                              [D]
  attn_norm.scale           [D]        model.layers.l.input_layernorm.weight          [D]
  attn.wq / wk / wv         [D, N E]   model.layers.l.self_attn.{q,k,v}_proj.weight   [N E, D]
  attn.wo                   [N E, D]   model.layers.l.self_attn.o_proj.weight         [D, N E]
  ffn_norm.scale            [D]        model.layers.l.post_attention_layernorm.weight [D]
  ffn.w_gate / w_up         [D, H]     model.layers.l.mlp.{gate,up}_proj.weight       [H, D]
  ffn.w_down                [H, D]     model.layers.l.mlp.down_proj.weight            [D, H]

Hugging Face keeps `nn.Linear` weights as [out, in], so every matrix but the embedding is
transposed. No permutation is needed: in both, the projection's output columns are head-major
([N, E]) and RoPE rotates each head's two halves (rotate-half, inv_freq = theta^(-2i/E));
transformers' conversion script permutes only Meta's original interleaved checkpoints, not
its own format. GQA groups query head n with key/value head n // (N / K) in both, and both
scale attention by E^-1/2 and compute the RMSNorm in f32.

Tokenizers: the byte tokenizer (UTF-8 bytes + 3; 0 pad, 1 bos, 2 eos) is written as a
`tokenizer.json` that `transformers.AutoTokenizer` loads (a BPE without merges whose 256
`<0xNN>` byte tokens take every byte through byte fallback, the way Llama's own tokenizer
spells bytes), a SentencePiece model as `tokenizer.model`, a Hugging Face `tokenizer.json`
("hf") as a copy of itself; `twell_tokenizer.json` names which it is (and the end-of-document
token), and is what `train.import_hf` reads back. A directory without it is read by its
`tokenizer.model`, else its `tokenizer.json`.

Problems with a directory (another architecture, missing or misshapen tensors, a tokenizer
that does not fit) raise `train.errors.CheckpointError` with the file and the field named.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any, Callable

import numpy as np

from train import errors
from train.data import tokenizer as tokenizer_lib
from train.models import transformer as model_lib

CheckpointError = errors.CheckpointError

TWELL_TOKENIZER = "twell_tokenizer.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# (our path inside a block, HF name inside model.layers.l, transposed)
LAYER_TENSORS = (
    (("attn_norm", "scale"), "input_layernorm.weight", False),
    (("attn", "wq"), "self_attn.q_proj.weight", True),
    (("attn", "wk"), "self_attn.k_proj.weight", True),
    (("attn", "wv"), "self_attn.v_proj.weight", True),
    (("attn", "wo"), "self_attn.o_proj.weight", True),
    (("ffn_norm", "scale"), "post_attention_layernorm.weight", False),
    (("ffn", "w_gate"), "mlp.gate_proj.weight", True),
    (("ffn", "w_up"), "mlp.up_proj.weight", True),
    (("ffn", "w_down"), "mlp.down_proj.weight", True),
)
# Tensors some Llama checkpoints carry that hold nothing to import (RoPE's fixed frequencies).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Start and padding tokens of common tokenizer.json files (Llama 3, Llama 2, Gemma),
# for config.json's bos / pad ids; the end-of-document token is the tokenizer's own.
HF_BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")
HF_PAD_TOKENS = ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>")

# Our activation -> transformers' `hidden_act` (the same function; jax.nn.gelu is the tanh form).
HF_ACTIVATIONS = {"relu": "relu", "silu": "silu", "gelu": "gelu_pytorch_tanh"}
FROM_HF_ACTIVATIONS = {v: k for k, v in HF_ACTIVATIONS.items()} | {"swish": "silu"}


def _error(where: str, what: str) -> CheckpointError:
  return CheckpointError(f"{where}: {what}")


# ---- config.json ----

def hf_config(mc: model_lib.ModelConfig, *, context: int, special_ids: dict, dtype: str,
              extra: dict | None = None) -> dict:
  """The config.json of a Llama with the model's shapes (`special_ids`: bos/eos/pad ids)."""
  if not mc.ffn_gated:
    raise _error("config.model", "ffn_gated=False (h = act(x W_up)) has no Llama form: "
                 "Llama's MLP is gated")
  theta = float(mc.rope_theta)
  cfg = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": mc.vocab_size, "hidden_size": mc.d_model,
      "intermediate_size": mc.d_ff, "num_hidden_layers": mc.n_layers,
      "num_attention_heads": mc.n_heads, "num_key_value_heads": mc.n_kv_heads,
      "head_dim": mc.head_dim, "hidden_act": HF_ACTIVATIONS[mc.ffn_activation],
      "max_position_embeddings": int(context), "rms_norm_eps": float(mc.norm_eps),
      # rope_theta for transformers 4.x, rope_parameters for 5.x: the same default RoPE.
      "rope_theta": theta, "rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": theta},
      "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
      "pretraining_tp": 1, "tie_word_embeddings": True,
      "initializer_range": float(mc.init_std), "use_cache": True,
      "torch_dtype": dtype,
      **{f"{k}_token_id": v for k, v in special_ids.items()},
  }
  if extra:
    cfg["twell_jax"] = extra
  return cfg


def model_fields(hf: dict, where: str) -> dict:
  """ModelConfig fields of a Llama config.json; CheckpointError for anything else."""
  model_type = hf.get("model_type")
  if model_type != "llama":
    raise _error(where, f"model_type {model_type!r} is not supported: only Llama-architecture "
                 "checkpoints (model_type 'llama') map onto this model")
  archs = hf.get("architectures") or ["LlamaForCausalLM"]
  if any(a not in ("LlamaForCausalLM", "LlamaModel") for a in archs):
    raise _error(where, f"architectures {archs} are not LlamaForCausalLM")
  act = hf.get("hidden_act", "silu")
  if act not in FROM_HF_ACTIVATIONS:
    raise _error(where, f"hidden_act {act!r} is not one of {sorted(FROM_HF_ACTIVATIONS)}")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise _error(where, f"{key}=true: this model has no biases")
  for key in ("rope_scaling", "rope_parameters"):
    rope = hf.get(key) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
      raise _error(where, f"{key} of type {kind!r}: only the default RoPE is implemented")
  try:
    d, n = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    fields = {
        "vocab_size": int(hf["vocab_size"]), "d_model": d,
        "n_layers": int(hf["num_hidden_layers"]), "n_heads": n,
        "n_kv_heads": int(hf.get("num_key_value_heads") or n),
        "d_ff": int(hf["intermediate_size"]),
        "rope_theta": float(hf.get("rope_theta") or
                            (hf.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "ffn_gated": True, "ffn_activation": FROM_HF_ACTIVATIONS[act],
    }
  except KeyError as e:
    raise _error(where, f"missing field {e.args[0]!r}") from None
  head_dim = hf.get("head_dim")
  if head_dim is not None and int(head_dim) * n != d:
    raise _error(where, f"head_dim={head_dim} x num_attention_heads={n} != hidden_size={d}: "
                 "this model derives the head dim as hidden_size / heads")
  return fields


# ---- tensors ----

def _block_leaf(blocks: Any, path: tuple, layer: int | None):
  node = blocks if layer is None else blocks[layer]
  for k in path:
    node = node[k]
  return node


def tensor_shapes(mc: model_lib.ModelConfig) -> dict[str, tuple]:
  """Every tensor name of the HF checkpoint of `mc` and its shape."""
  d, e, h = mc.d_model, mc.head_dim, mc.d_ff
  ours = {("attn_norm", "scale"): (d,), ("attn", "wq"): (d, mc.n_heads * e),
          ("attn", "wk"): (d, mc.n_kv_heads * e), ("attn", "wv"): (d, mc.n_kv_heads * e),
          ("attn", "wo"): (mc.n_heads * e, d), ("ffn_norm", "scale"): (d,),
          ("ffn", "w_gate"): (d, h), ("ffn", "w_up"): (d, h), ("ffn", "w_down"): (h, d)}
  shapes = {"model.embed_tokens.weight": (mc.vocab_size, d), "model.norm.weight": (d,)}
  for l in range(mc.n_layers):
    for path, name, transposed in LAYER_TENSORS:
      s = ours[path]
      shapes[f"model.layers.{l}.{name}"] = s[::-1] if transposed else s
  return shapes


def to_hf_tensors(params: dict, mc: model_lib.ModelConfig, dtype) -> dict[str, np.ndarray]:
  """The HF tensors of `params` (either layout) as host arrays of `dtype`."""
  cast = lambda a: np.ascontiguousarray(np.asarray(a).astype(dtype))
  blocks = model_lib.stacked_blocks(params, mc.n_layers)
  out = {"model.embed_tokens.weight": cast(params["embed"]),
         "model.norm.weight": cast(params["final_norm"]["scale"])}
  for path, name, transposed in LAYER_TENSORS:
    stacked = np.asarray(_block_leaf(blocks, path, None))
    for l in range(mc.n_layers):
      out[f"model.layers.{l}.{name}"] = cast(stacked[l].T if transposed else stacked[l])
  return out


def from_hf_tensors(get: Callable[[str], np.ndarray], names: set[str],
                    mc: model_lib.ModelConfig, where: str) -> dict:
  """Our params (the layout of `mc.scan_layers`, dtype `mc.param_dtype`) from HF tensors.

  `get(name)` reads one tensor, `names` are all the checkpoint holds. Missing, misshapen
  or unexpected tensors, and an untied LM head that differs from the embedding, raise
  CheckpointError.
  """
  shapes = tensor_shapes(mc)
  missing = sorted(set(shapes) - names)
  if missing:
    raise _error(where, f"{len(missing)} tensors missing, e.g. {missing[:4]}")
  known = set(shapes) | {"lm_head.weight"}
  extra = sorted(n for n in names - known if not n.endswith(IGNORED_SUFFIXES))
  if extra:
    raise _error(where, f"tensors this architecture has no place for (biases, other "
                 f"modules): {extra[:4]}{' ...' if len(extra) > 4 else ''}")
  dt = np.dtype(model_lib.DTYPES[mc.param_dtype])

  def read(name):
    a = np.asarray(get(name))
    if tuple(a.shape) != shapes[name]:
      raise _error(where, f"{name} has shape {tuple(a.shape)}, but config.json implies "
                   f"{shapes[name]}")
    return a.astype(dt)

  embed = read("model.embed_tokens.weight")
  if "lm_head.weight" in names:
    head = np.asarray(get("lm_head.weight"))
    if head.shape != embed.shape or not np.array_equal(head.astype(dt), embed):
      raise _error(where, "lm_head.weight differs from model.embed_tokens.weight: this model "
                   "ties them (logits = h embed^T), so an untied head cannot be imported")
  layers = []
  for l in range(mc.n_layers):
    block: dict = {}
    for path, name, transposed in LAYER_TENSORS:
      a = read(f"model.layers.{l}.{name}")
      block.setdefault(path[0], {})[path[1]] = np.ascontiguousarray(a.T if transposed else a)
    layers.append(block)
  params = {"embed": embed, "final_norm": {"scale": read("model.norm.weight")}}
  if mc.scan_layers:
    import jax  # pylint: disable=import-outside-toplevel
    params["blocks"] = jax.tree.map(lambda *a: np.stack(a), *layers)
  else:
    params["blocks"] = dict(enumerate(layers))
  return params


@contextlib.contextmanager
def open_tensors(hf_dir: str):
  """(get(name) -> np.ndarray, names) over model.safetensors or a sharded index."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  index = os.path.join(hf_dir, WEIGHTS_INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
  elif os.path.isfile(os.path.join(hf_dir, WEIGHTS)):
    files, weight_map = [WEIGHTS], None
  else:
    found = sorted(n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth")))
    raise _error(hf_dir, f"no {WEIGHTS} or {WEIGHTS_INDEX}"
                 + (f" (found {found[:3]}: only safetensors checkpoints are read)"
                    if found else ""))
  with contextlib.ExitStack() as stack:
    handles = {}
    for name in files:
      path = os.path.join(hf_dir, name)
      try:
        handles[name] = stack.enter_context(safe_open(path, "numpy"))
      except Exception as e:  # pylint: disable=broad-except  # safetensors raises its own types
        raise _error(path, f"unreadable safetensors file ({type(e).__name__}: {e})") from None
    if weight_map is None:
      weight_map = {k: WEIGHTS for k in handles[WEIGHTS].keys()}

    def get(name):
      return handles[weight_map[name]].get_tensor(name)

    yield get, set(weight_map)


def save_tensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  st_numpy.save_file(tensors, path, metadata={"format": "pt"})


# ---- tokenizers ----

def _byte_tokenizer_json() -> dict:
  special = ["<pad>", "<s>", "</s>"]
  vocab = {tok: i for i, tok in enumerate(special)}
  vocab.update({f"<0x{b:02X}>": b + 3 for b in range(256)})
  return {
      "version": "1.0", "truncation": None, "padding": None,
      "added_tokens": [{"id": i, "content": tok, "single_word": False, "lstrip": False,
                        "rstrip": False, "normalized": False, "special": True}
                       for i, tok in enumerate(special)],
      "normalizer": None, "pre_tokenizer": None, "post_processor": None,
      "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"},
                                                   {"type": "Fuse"}]},
      "model": {"type": "BPE", "dropout": None, "unk_token": None,
                "continuing_subword_prefix": None, "end_of_word_suffix": None,
                "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
                "vocab": vocab, "merges": []},
  }


def _hf_special_tokens(tokenizer) -> dict:
  """bos / eos / pad token names of an "hf" tokenizer: its end-of-document token, and the
  first of the common start and padding tokens its vocabulary holds (else None)."""
  first = lambda names: next((t for t in names if tokenizer.token_to_id(t) is not None), None)
  return {"bos": first(HF_BOS_TOKENS), "eos": tokenizer.eos_token, "pad": first(HF_PAD_TOKENS)}


def special_ids(data_cfg, tokenizer) -> dict:
  """bos / eos / pad ids of the tokenizer a config names (for config.json; None: it has none)."""
  if data_cfg.tokenizer == "byte":
    return {"bos": tokenizer_lib.BOS_ID, "eos": tokenizer_lib.EOS_ID, "pad": tokenizer_lib.PAD_ID}
  if data_cfg.tokenizer == "hf":
    return {k: (None if t is None else tokenizer.token_to_id(t))
            for k, t in _hf_special_tokens(tokenizer).items()}
  sp = tokenizer._sp  # pylint: disable=protected-access
  ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}
  return {k: (v if v >= 0 else None) for k, v in ids.items()}


def write_tokenizer(out_dir: str, data_cfg, tokenizer, context: int) -> list[str]:
  """Writes the tokenizer files a Hugging Face directory carries; returns their names."""
  base = {"model_max_length": int(context), "clean_up_tokenization_spaces": False}
  common = {**base, "add_bos_token": False, "add_eos_token": False}
  if data_cfg.tokenizer == "byte":
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
      json.dump(_byte_tokenizer_json(), f)
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "pad_token": "<pad>", **common}
    ours = {"type": "byte", "offset": 3, "pad_id": tokenizer_lib.PAD_ID,
            "bos_id": tokenizer_lib.BOS_ID, "eos_id": tokenizer_lib.EOS_ID,
            "vocab_size": tokenizer.vocab_size}
    files = ["tokenizer.json"]
  elif data_cfg.tokenizer == "hf":
    shutil.copyfile(data_cfg.tokenizer_file, os.path.join(out_dir, "tokenizer.json"))
    # The file's own post-processor decides what special tokens encoding adds: no
    # add_bos_token / add_eos_token here to override it.
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
               **{f"{k}_token": t for k, t in _hf_special_tokens(tokenizer).items()}, **base}
    ours = {"type": "hf", "file": "tokenizer.json", "eos_token": tokenizer.eos_token,
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    files = ["tokenizer.json"]
  else:
    shutil.copyfile(data_cfg.spm_model, os.path.join(out_dir, "tokenizer.model"))
    sp = tokenizer._sp  # pylint: disable=protected-access
    piece = lambda i: sp.id_to_piece(i) if i >= 0 else None
    tok_cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": piece(sp.bos_id()),
               "eos_token": piece(sp.eos_id()), "unk_token": piece(sp.unk_id()),
               "pad_token": piece(sp.pad_id()), "legacy": True, **common}
    ours = {"type": "sentencepiece", "file": "tokenizer.model",
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    files = ["tokenizer.model"]
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({k: v for k, v in tok_cfg.items() if v is not None}, f, indent=1)
  with open(os.path.join(out_dir, TWELL_TOKENIZER), "w") as f:
    json.dump(ours, f, indent=1)
  return files + ["tokenizer_config.json", TWELL_TOKENIZER]


def read_tokenizer(hf_dir: str) -> dict | None:
  """The `data` config fields of the tokenizer a directory ships (`tokenizer` and its file:
  `spm_model` or `tokenizer_file`, and `eos_token` where twell_tokenizer.json names it), None
  when it ships none this trainer reads.

  In order: twell_tokenizer.json (what `write_tokenizer` wrote), a SentencePiece
  tokenizer.model (Llama 2 ships both it and a tokenizer.json of the same vocabulary), a
  tokenizer.json (the `tokenizers` library; its end-of-document token as `HFTokenizer` finds
  it).
  """
  ours = os.path.join(hf_dir, TWELL_TOKENIZER)
  if os.path.isfile(ours):
    with open(ours) as f:
      desc = json.load(f)
    if desc.get("type") == "byte":
      expected = {"offset": 3, "pad_id": tokenizer_lib.PAD_ID, "bos_id": tokenizer_lib.BOS_ID,
                  "eos_id": tokenizer_lib.EOS_ID}
      got = {k: desc.get(k) for k in expected}
      if got != expected:
        raise _error(ours, f"a byte tokenizer with ids {got}, not this trainer's {expected}")
      return {"tokenizer": "byte"}
    if desc.get("type") in ("sentencepiece", "hf"):
      default = "tokenizer.model" if desc["type"] == "sentencepiece" else "tokenizer.json"
      path = os.path.join(hf_dir, desc.get("file", default))
      if not os.path.isfile(path):
        raise _error(ours, f"names {path}, which is missing")
      if desc["type"] == "sentencepiece":
        return {"tokenizer": "sentencepiece", "spm_model": path}
      return {"tokenizer": "hf", "tokenizer_file": path, "eos_token": desc.get("eos_token")}
    raise _error(ours, f"unknown tokenizer type {desc.get('type')!r}")
  path = os.path.join(hf_dir, "tokenizer.model")
  if os.path.isfile(path):
    return {"tokenizer": "sentencepiece", "spm_model": path}
  path = os.path.join(hf_dir, "tokenizer.json")
  if os.path.isfile(path):
    return {"tokenizer": "hf", "tokenizer_file": path}
  return None
