"""Measurement: how the claims are measured, never what a user trains with.

- ``memory``: exact byte accounting, analytic and measured with MemTracker (real or fake tensors), depth
  extrapolation;
- ``gradients``: per-layer gradient norms, controlled-spectrum stacks, Jacobian spectra, growth-rate fits and
  gradient-variance estimators (claims C2, C6);
- ``clipping``: the update an optimizer makes with and without gradient clipping on one gradient stream (C3);
- ``zero3``: the ZeRO-3 / FSDP communication model (alpha-beta ring collectives, FLOPs, overlapped schedule);
- ``calibrate``: collectives and a real FSDP2 (``fully_shard``) step timed on launched ranks (C5);
- ``comm_bench``: gradient buckets and windows against DDP, and the dead-rank demonstrations (C9).

Submodules are imported on use: ``from macroarch.measure.memory import measure_training_step``.
"""
