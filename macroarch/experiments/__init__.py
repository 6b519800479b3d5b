"""Experiments: the one training loop and one harness module per claim group; the notebooks call these.

- ``loop``: ``train_lm``, ``train_round_robin``, ``evaluate_lm``: the language-model training and evaluation
  loop every experiment uses;
- one harness per notebook, named after it (``mvas_llama``, ``mixed_precision``, ``comm_bucketing``,
  ``convergence_recipe``, ...): the runs, the numbers the verdict reads, the figures and the verdict's texts.
"""
