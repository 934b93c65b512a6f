"""ReLUfication: a SiLU-gated Llama-style model fine-tuned into a sparse ReLU one.

  python -m train.main --config=configs/relufy.py --config.init_from_hf.path=HF_DIR --workdir=W

The model's shapes and tokenizer come from HF_DIR (`train/import_hf.py`); its gate's SiLU is
replaced by a ReLU (the up projection and everything else are kept), and fine-tuning with the
L1 penalty, ramped in over the first steps, lets the model recover its loss while most FFN
activations become exactly zero (the route "ReLU strikes back" and later sparsity work take
with pretrained models). `python -m train.report --workdir=W` plots the activity falling.

Training settings are a fine-tune's: a lower peak learning rate than pre-training, a short
warm-up, the L1 coefficient ramped from 0. `configs/relufy.py:tiny` is the CPU-sized run
(the tiny config's data and batch) used by docs/training.md and the tests.
"""

from configs import default


def get_config(variant: str | None = None):
  c = default.get_config()
  c.init_from_hf.activation = "relu"
  c.model.ffn_activation = "relu"
  c.num_train_steps = 2000
  c.learning_rate = 1e-4
  c.warmup_steps = 100
  c.l1_coeff = 2e-5
  c.l1_warmup_steps = 500
  c.weight_decay = 0.0
  if variant == "tiny":
    c.data.seq_len = 64
    c.model.dtype = "float32"
    c.batch_size = 16
    c.num_train_steps = 150
    c.learning_rate = 1e-3
    c.warmup_steps = 10
    c.l1_coeff = 3e-3
    c.l1_warmup_steps = 10
    c.dead_window_tokens = 20_000
    c.log_every = 10
    c.eval_every = 75
    c.eval_batches = 4
    c.checkpoint_every = 50
    c.keep_checkpoints = 2
  elif variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny' or none")
  return c
