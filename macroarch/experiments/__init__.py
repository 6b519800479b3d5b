"""Experiments: the one training loop and one harness module per claim group; the notebooks call these.

- ``loop``: ``train_lm``, ``train_round_robin``, ``evaluate_lm``: the language-model training and evaluation
  loop every experiment uses;
- ``optim``: the training runs that notebooks 06 (C8) and 08 (C10) sweep.
"""
