"""The paper's model shapes: D=2048, H=5632, 32 heads, context 2048.

0.5B / 1B / 1.5B / 2B differ only in depth: 8 / 18 / 28 / 38 layers. Used by
configs/paper_*.py; `get_paper_config(layers, variant)` also accepts
variant "dense" for the SiLU dense baseline.
"""

from configs import default


def get_paper_config(n_layers: int, variant: str | None = None):
  c = default.get_config()
  c.model.update(d_model=2048, d_ff=5632, n_heads=32, n_kv_heads=32,
                 n_layers=n_layers, vocab_size=32_000, remat=True,
                 scan_layers=True)
  c.data.update(dataset="c4/en", seq_len=2048, tokenizer="sentencepiece")
  c.batch_size = 256
  c.grad_accum_steps = 8
  c.learning_rate = 3e-4
  c.warmup_steps = 2000
  c.num_train_steps = 50_000
  return default.apply_variant(c, variant)
