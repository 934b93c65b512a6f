"""Paper shape, 38 layers (D=2048, H=5632, 32 heads, context 2048).

Needs a prepared TFDS dataset and a SentencePiece model:
  --config.data.spm_model=/path/to/32k.model (vocab_size must match).
"""

from configs import paper_shapes


def get_config(variant=None):
  c = paper_shapes.get_paper_config(38, variant)
  # FSDP over every device: parameters and AdamW state split, not replicated (several
  # hosts: --config.mesh.data=<hosts> keeps the weight gathers within each host).
  c.mesh.update(data=1, fsdp=-1)
  return c
