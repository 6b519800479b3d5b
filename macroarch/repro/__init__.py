"""Reproduction machinery: how a measured claim becomes a row of the paper.

- ``claims``: the registry of the post's claims, their targets and the rules that grade a measurement;
- ``tracking``: ``start_run`` writes ``result.json`` and a W&B run (offline by default) with the same numbers;
- ``wandb_offline``: reads offline W&B runs back, so the paper can be built from W&B;
- ``runner``: batch execution of the notebooks with papermill, per profile, resumable;
- ``paper``: the verdict table and report built from results;
- ``cli``: the ``macroarch`` command.
"""
