"""Reproduction machinery: how a measured claim becomes a row of the paper.

- ``claims``: the registry of the post's claims, their targets and the rules that grade a measurement;
- ``notebook``: a notebook's parameters cell, resolved against its profile (what ran is what is recorded);
- ``tracking``: ``start_run`` writes ``result.json`` and a W&B run (offline by default) with the same numbers;
- ``wandb_sidecar``: the process that owns a run's W&B side, so W&B faults never reach the measurement;
- ``wandb_offline``: reads offline W&B runs back, so the paper can be built from W&B;
- ``profiles``: ``papermill_runs/<profile>.yaml``, checked against the notebooks before anything runs;
- ``runner``: batch execution of the notebooks with papermill, per profile, resumable, locked;
- ``progress``: the live line (cells done, elapsed) while a notebook runs;
- ``paper``: each claim's latest run, merged into its profile's paper;
- ``cli``: the ``macroarch`` command.
"""
