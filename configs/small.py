"""~100M parameters (D=768, H=2816, 12 layers), for one GPU.

`--config=configs/small.py:dense` is the dense-FFN baseline (SiLU-gated,
implementation "dense", no L1), same shapes.
"""

from configs import default


def get_config(variant: str | None = None):
  c = default.get_config()
  c.model.update(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                 d_ff=2816, vocab_size=384)
  c.data.seq_len = 1024
  c.num_train_steps = 20_000
  c.batch_size = 32
  c.learning_rate = 6e-4
  c.warmup_steps = 1000
  c.log_every = 50
  return default.apply_variant(c, variant)
