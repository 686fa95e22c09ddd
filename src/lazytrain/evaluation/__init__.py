"""Evaluation and generation through the streaming engine's weight path: held-out loss, greedy
and sampled generation, and the lm-eval model, without a second full copy of the model."""
