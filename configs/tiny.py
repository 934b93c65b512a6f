"""Tiny CPU config: a short run on 2 cores in about a minute.

Uses the offline corpus and a larger L1 coefficient than the paper so that
the sparsity visibly rises within the few hundred steps of the run.
`configs/tiny.py:dense` is the dense SiLU-gated model of the same shape (no L1): a model to
ReLUfy (configs/relufy.py).
"""

from configs import default


def get_config(variant: str | None = None):
  c = default.get_config()
  c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
                 dtype="float32")
  c.data.seq_len = 64
  c.num_train_steps = 300
  c.batch_size = 16
  c.learning_rate = 3e-3
  c.warmup_steps = 30
  c.l1_coeff = 1e-3
  c.l1_warmup_steps = 50
  c.dead_window_tokens = 20_000
  c.log_every = 25
  c.eval_every = 150
  c.eval_batches = 4
  c.checkpoint_every = 50
  c.keep_checkpoints = 2
  return default.apply_variant(c, variant)
