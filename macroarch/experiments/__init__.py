"""Experiments: the one training loop and one harness module per notebook; the notebooks call these.

- ``loop``: ``train_lm``, ``train_round_robin``, ``evaluate_lm``: the language-model training and evaluation
  loop every experiment uses;
- ``hardware``: what this machine computes fast (``auto_compute_dtype``) and what every run records of it;
- ``settings``: the base of each harness's frozen settings dataclass, built by a notebook from its resolved
  parameters (``X.from_params(params)``), which refuses a key it does not know;
- one harness per notebook, named after it: ``gradient_explosion`` (01), ``memory_wall`` (02),
  ``zero3_communication`` (03), ``dgr_variance`` (04), ``mvas_llama`` (05), ``mixed_precision`` (06),
  ``comm_bucketing`` (07), ``convergence_recipe`` (08), ``hardware_speedups`` (09), ``applications`` (10),
  ``clip`` (11): the runs, the numbers the verdict reads, the figures and the verdict's texts.

Harnesses never import the reproduction layer, not even inside a function (``tests/test_imports.py`` holds every
layer to the ones below it): a notebook passes its tracking run in, and whatever else a harness needs of the claim
(a target to draw), and grades the claim.
"""
