"""Optimizer and schedules (optax).

  lr(s)  = peak * s / warmup for s < warmup, then cosine from peak down to
           min_lr_ratio * peak at num_train_steps.
  tx     = clip_by_global_norm(grad_clip) -> AdamW(lr, b1, b2, eps,
           weight_decay on every parameter of rank >= 2, i.e. not on the
           RMSNorm scales).
  l1(s)  = l1_coeff * min(1, s / l1_warmup_steps)  (constant if no warm-up).

Gradient accumulation is done inside the train step (a scan over
micro-batches, see train.state.steps), so one optax update is one training step.
"""

import jax
import optax


def lr_schedule(cfg) -> optax.Schedule:
  peak = cfg.learning_rate
  warmup = max(0, min(cfg.warmup_steps, cfg.num_train_steps - 1))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(cfg.num_train_steps, warmup + 1),
      end_value=peak * cfg.min_lr_ratio)


def l1_schedule(cfg) -> optax.Schedule:
  if cfg.l1_warmup_steps > 0:
    return optax.linear_schedule(0.0, cfg.l1_coeff, cfg.l1_warmup_steps)
  return optax.constant_schedule(cfg.l1_coeff)


def decay_mask(params):
  """True where weight decay applies: matrices and embeddings, not norms."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(lr_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2,
                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                  mask=decay_mask),
  )
