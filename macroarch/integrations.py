"""MVAS, DGR and the optimizers of this package inside HF ``Trainer`` (and so accelerate).

What needs nothing from here:

- **MVAS** works with a plain ``transformers.Trainer`` and with accelerate: pass the optimizer,
  ``Trainer(..., optimizers=(MVASAdamW(model.parameters(), lr=...), None))`` or
  ``optimizer_cls_and_kwargs=(MVASAdamW, {...})``; Trainer's default optimizer (torch's AdamW), like any
  optimizer that cannot write packed weights, raises a ``TypeError`` naming ``MVASAdamW`` at its first step.
  ``model.save_pretrained`` / ``Trainer.save_model`` write dense weights in the training dtype (the values the
  model computes with), so ``from_pretrained`` on a plain model gives the same logits; ``save_pretrained(model,
  dir, packed=True)`` here writes the packed form, which only ``from_pretrained`` here reads: transformers'
  ``from_pretrained`` on that directory fails with an error naming ``macroarch.integrations.from_pretrained``
  (``save_pretrained`` below), and a ``README.md`` beside it says so. ``safetensors.torch.save_file(
  model.state_dict())`` refuses managed weights ("non contiguous tensor", safetensors' message: the call never
  reaches macroarch): save ``mvas.dense_state_dict(model)``, or the exact packed file with ``mvas.save_packed``.
- **accelerate**: ``accelerator.prepare(model, optimizer, ...)`` and ``accelerator.accumulate(model)`` work with
  MVAS models and ``MVASAdamW``, and with ``DGRWrapper`` built with ``accumulation_steps`` equal to the
  accelerator's ``gradient_accumulation_steps``. ``save_state`` / ``load_state`` need
  ``register_mvas_checkpointing(accelerator)`` (below) for an MVAS model: accelerate's own safetensors loader
  refuses managed weights, and its dense file would be re-packed on load.

What ``MacroTrainer`` (a ``Trainer`` subclass) adds, because Trainer's loop assumes that gradients exist until
``optimizer.step()`` and that the optimizer neither scales the loss nor skips steps:

- **DGR** (the model is a ``DGRWrapper``, or the optimizer a ``DGROptimizer``): groups step during backward and
  free their gradients, so Trainer's own clipping and gradient norm see nothing (it logs 0 and
  ``max_grad_norm`` does nothing). Here DGR's accumulation follows ``gradient_accumulation_steps``,
  ``max_grad_norm`` becomes DGR's per-group clipping norm (deviation: per group, not global, since a global
  norm needs every gradient before the first update; with more than one group it warns once, giving the bound
  ``sqrt(G) * max_grad_norm`` on the clipped whole), and the logged ``grad_norm`` is the norm of the whole
  gradient before clipping, assembled from the groups as they stepped. Without an optimizer, the DGR optimizer
  is built with Trainer's optimizer class and settings (one weight decay for all, no per-parameter groups).
  The loss of every micro-batch is shown to the DGR optimizer, so a non-finite one skips the step.
- **CompensatedAdamW**: the loss is scaled by its ``grad_scale`` before backward, gradients are unscaled before
  Trainer clips them (so ``max_grad_norm`` and the logged norm are the true gradient's), its spike guard sees
  every micro-batch's loss, and its ``accumulation_steps`` must be 1: Trainer accumulates
  (``gradient_accumulation_steps``), and two accumulations would update once per ``k * k`` micro-batches
  while the LR schedule advanced ``k`` times (use ``master_weights=True`` for fp32 masters).
- **skipped steps** (a non-finite gradient or loss, a spike-guard skip) do not advance the LR schedule, as
  Trainer does for fp16 overflows.
- ``Trainer(model=DGRWrapper(...))``: the wrapper's forward has the wrapped model's signature (so Trainer keeps the
  dataset columns), and here the label names are read from the wrapped model and the wrapped model is what is
  saved. A plain ``Trainer`` warns once, naming ``MacroTrainer``: at the first step of a DGR optimizer (its clipping
  and norm see no gradient), or at the first forward of a wrapper it trains with an optimizer of its own (DGR off).
- **checkpoints**: an MVAS model's checkpoints also hold its packed weights (``mvas.save_packed``), and
  ``resume_from_checkpoint`` restores them bit for bit; with the optimizers' own ``state_dict`` (``DGROptimizer``
  goes through each group's optimizer) a resumed run continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from dataclasses import replace
from typing import Any

import torch
from transformers import Trainer
from transformers.utils import find_labels

from macroarch import mvas
from macroarch.dgr import DGROptimizer, DGRWrapper
from macroarch.optim import CompensatedAdamW


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def step_was_skipped(optimizer: Any) -> bool:
    """Whether the optimizer's last ``step()`` skipped its update (non-finite values, a spike guard)."""
    return bool(getattr(_unwrap_optimizer(optimizer), "step_was_skipped", False))


class _SkipAwareSchedule:
    """An LR scheduler that does not advance when the optimizer skipped its step; everything else delegated."""

    def __init__(self, scheduler: Any, trainer: Trainer) -> None:
        self.scheduler, self._trainer = scheduler, trainer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not step_was_skipped(self._trainer.optimizer):
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class MacroTrainer(Trainer):
    """``transformers.Trainer`` that keeps DGR and ``CompensatedAdamW`` right (module docstring). Same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configured: Any = None
        wrapper = self._dgr_wrapper()
        if wrapper is not None and self.args.label_names is None:
            self.label_names = find_labels(type(wrapper.module))  # Trainer read them from the wrapper's class

    # ------------------------------------------------------------------------------------------ set-up
    def _dgr_wrapper(self) -> DGRWrapper | None:
        model = self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model
        return model if isinstance(model, DGRWrapper) else None

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        wrapper = self._dgr_wrapper()
        if self.optimizer is None and wrapper is not None:
            cls, kwargs = (self.optimizer_cls_and_kwargs if self.optimizer_cls_and_kwargs is not None
                           else self.get_optimizer_cls_and_kwargs(self.args, wrapper.module))
            self.optimizer = wrapper.optimizer(cls, **{"weight_decay": self.args.weight_decay, **kwargs})
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, _SkipAwareSchedule):
            self.lr_scheduler = _SkipAwareSchedule(scheduler, self)
        return self.lr_scheduler

    def _configure(self) -> Any:
        """Once, before the first backward: fit the optimizer to Trainer's accumulation and clipping."""
        opt = _unwrap_optimizer(self.optimizer)
        if self._configured is opt:
            return opt
        k = self.args.gradient_accumulation_steps
        if isinstance(opt, DGROptimizer):
            opt.config = replace(opt.config, accumulation_steps=k)
            if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                for group in opt.param_groups:
                    if group["max_grad_norm"] is None:
                        group["max_grad_norm"] = self.args.max_grad_norm
                _warn_per_group_clipping(opt, self.args.max_grad_norm)
            opt.track_grad_norm = True
        if isinstance(opt, CompensatedAdamW) and opt.accumulation_steps != 1:
            raise ValueError(
                f"CompensatedAdamW(accumulation_steps={opt.accumulation_steps}) under Trainer: Trainer accumulates "
                f"gradients itself (gradient_accumulation_steps={k}), so the optimizer would update once per "
                f"{opt.accumulation_steps * k} micro-batches while the LR schedule advances once per {k}. Build it "
                "with accumulation_steps=1 (master_weights=True for fp32 master weights) and set "
                "TrainingArguments(gradient_accumulation_steps=...)")
        if not isinstance(self.lr_scheduler, _SkipAwareSchedule) and self.lr_scheduler is not None:
            self.lr_scheduler = _SkipAwareSchedule(self.lr_scheduler, self)
        self._configured = opt
        return opt

    # --------------------------------------------------------------------------------------- training
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Trainer's step, with the loss shown to the optimizer (and scaled by it) just before backward."""
        opt = self._configure()
        if not isinstance(opt, DGROptimizer | CompensatedAdamW):
            return super().training_step(model, inputs, num_items_in_batch)
        backward = self.accelerator.backward

        def backward_seen(loss: torch.Tensor, **kwargs: Any) -> None:
            if isinstance(opt, DGROptimizer):
                opt.observe_loss(loss)
                return backward(loss, **kwargs)
            if opt.spike_guard is not None:
                opt.spike_guard.observe(loss)
            return backward(opt.scale_loss(loss), **kwargs)

        self.accelerator.backward = backward_seen  # this call only; the method comes back below
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del self.accelerator.backward

    def _clip_grad_norm(self, model: Any) -> Any:
        opt = _unwrap_optimizer(self.optimizer)
        if isinstance(opt, DGROptimizer):
            return opt.grad_norm()  # clipped per group as each stepped (in backward)
        if isinstance(opt, CompensatedAdamW):
            opt.unscale_()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        opt = _unwrap_optimizer(self.optimizer)
        if isinstance(opt, DGROptimizer):
            return opt.grad_norm() if grad_norm is None else grad_norm
        if isinstance(opt, CompensatedAdamW) and grad_norm is None:
            opt.unscale_()
        return super()._get_grad_norm(model, grad_norm)

    # ------------------------------------------------------------------------------- DGRWrapper as model
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's save (dense weights, of what a ``DGRWrapper`` wraps), plus the packed weights of an MVAS model
        (``mvas.save_packed`` under ``mvas.PACKED_WEIGHTS_NAME``), which ``_load_from_checkpoint`` restores exactly."""
        wrapper = self._dgr_wrapper()
        if wrapper is None:
            super()._save(output_dir, state_dict)
        else:
            model, self.model = self.model, wrapper.module  # save what the wrapper wraps, under its own names
            try:
                super()._save(output_dir, state_dict)
            finally:
                self.model = model
        module = self._module()
        if self.args.should_save and _is_managed(module):
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            mvas.save_packed(module, os.path.join(output_dir, mvas.PACKED_WEIGHTS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """An MVAS model resumes from its packed weights, bit for bit (the dense file Trainer reads would be
        re-packed: another rounding); anything else as Trainer does."""
        packed = os.path.join(resume_from_checkpoint, mvas.PACKED_WEIGHTS_NAME)
        module = self._module()
        if os.path.isfile(packed) and _is_managed(module):
            mvas.load_packed(module, packed)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _module(self) -> Any:
        """The user's model: inside accelerate's wrapping and the ``DGRWrapper``, if any."""
        wrapper = self._dgr_wrapper()
        if wrapper is not None:
            return wrapper.module
        return self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model


def _warn_per_group_clipping(opt: DGROptimizer, max_norm: float) -> None:
    """Warn (once per optimizer: ``_configure`` runs once for it) where ``max_grad_norm`` cannot mean what Trainer
    means by it: Trainer clips the whole gradient's norm, DGR each group's as it steps (module docstring), so with
    G groups the whole clipped gradient may reach ``sqrt(G) * max_norm``; and a group given its own norm
    (``DGRWrapper(max_grad_norm=...)``) keeps it."""
    norms = [group["max_grad_norm"] for group in opt.param_groups]
    own = sorted({n for n in norms if n != max_norm})
    if len(norms) < 2 and not own:
        return
    message = (f"TrainingArguments(max_grad_norm={max_norm}) under DGR clips each of the {len(norms)} groups' "
               f"gradients to its norm as the group steps in backward, not the whole gradient's: the clipped "
               f"gradient's norm can reach {max_norm * len(norms) ** 0.5:.3g} (sqrt({len(norms)}) x {max_norm}), "
               "since a global norm needs every gradient before the first group updates")
    if own:
        message += (f"; {sum(n != max_norm for n in norms)} groups keep the max_grad_norm DGRWrapper gave them "
                    f"({', '.join(map(str, own))})")
    warnings.warn(message + ". Set max_grad_norm=0 for no clipping, or choose per-group norms with "
                  "DGRWrapper(max_grad_norm=...)", UserWarning, stacklevel=3)


def _is_managed(model: Any) -> bool:
    """Whether ``model`` holds MVAS-managed (packed) weights."""
    return any(isinstance(p, mvas.MVASWeight) for p in model.parameters())


def register_mvas_checkpointing(accelerator: Any) -> list[Any]:
    """Make accelerate's ``save_state`` / ``load_state`` exact for MVAS models; returns the two hooks' handles.

    accelerate writes each model's ``state_dict`` with safetensors (dense, as ``save_pretrained`` does) and reads it
    back with ``safetensors.torch.load_model``, which refuses a model whose state dict holds managed weights ("None
    is covering the entire storage": an ``MVASWeight`` views packed storage smaller than its dense size). With these
    hooks, every prepared model that holds managed weights is saved by ``mvas.save_packed`` as
    ``mvas_model.safetensors`` (``mvas_model_<i>.safetensors`` for the i-th such model) and loaded by
    ``mvas.load_packed``, bit for bit and with its checks; accelerate saves and loads everything else (other
    models, optimizers, schedulers, RNG states) as usual. Register them before ``save_state`` and, in the resumed
    run, before ``load_state``."""

    def managed(models: list[Any]) -> list[tuple[int, Any]]:
        found = []
        for index, model in enumerate(models):
            module = accelerator.unwrap_model(model)
            if isinstance(module, DGRWrapper):
                module = module.module
            if _is_managed(module):
                found.append((index, module))
        return found

    def name(k: int) -> str:
        stem, ext = os.path.splitext(mvas.PACKED_WEIGHTS_NAME)
        return mvas.PACKED_WEIGHTS_NAME if k == 0 else f"{stem}_{k}{ext}"

    def save(models: list[Any], weights: list[Any], output_dir: str) -> None:
        found = managed(models)
        if accelerator.is_main_process:
            for k, (_, module) in enumerate(found):
                mvas.save_packed(module, os.path.join(output_dir, name(k)))
        for index, _ in reversed(found):  # accelerate writes the rest, numbered as load_state will see them
            del weights[index]

    def load(models: list[Any], input_dir: str) -> None:
        found = managed(models)
        for k, (_, module) in enumerate(found):
            path = os.path.join(input_dir, name(k))
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no packed MVAS weights; the checkpoint was saved without "
                                        "register_mvas_checkpointing(accelerator), or by another set of models")
            mvas.load_packed(module, path)
        for index, _ in reversed(found):
            del models[index]

    return [accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)]


PACKED_STUB_SHARD = ("MVAS-packed weights - load with macroarch.integrations.from_pretrained - see README.md - "
                     "model.safetensors")
"""The one shard that the ``model.safetensors.index.json`` of a packed directory lists for every weight: it does not
exist, so transformers' ``from_pretrained`` (and any loader that follows the index) stops at once with an error that
quotes this name, before any weight is read or initialised."""

_DENSE_FILES = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json")

_PACKED_README = """# MVAS-packed weights: not loadable by `from_pretrained` of transformers

`{weights}` holds this model's weights as MVAS stores them (fp8/fp4 payloads with block scales), written by
`macroarch.integrations.save_pretrained(model, dir, packed=True)`. transformers' `from_pretrained` cannot read it:
`model.safetensors.index.json` here sends it to a shard that does not exist, whose name says what to do instead, so
it stops with that name in its error rather than build a model from other weights. Load it with macroarch, bit for
bit:

    from macroarch.integrations import from_pretrained
    model, store = from_pretrained({model_cls}, "this/directory")

For weights that any loader reads, save dense instead: `save_pretrained(model, dir)` (or `model.save_pretrained`),
the values the model computes with, in its training dtype.
"""


def _remove(directory: str, patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        for path in glob.glob(os.path.join(glob.escape(directory), pattern)):
            os.remove(path)


def _remove_packed(directory: str) -> None:
    """A packed save's files in ``directory``, after a dense save into it: the packed weights, and the README and the
    stub index if they are still this module's (a sharded dense save has written its own index over the stub)."""
    _remove(directory, (mvas.PACKED_WEIGHTS_NAME,))
    readme, index = os.path.join(directory, "README.md"), os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(readme):
        with open(readme) as f:
            if f.read().startswith(_PACKED_README.split("\n", 1)[0]):
                os.remove(readme)
    if os.path.isfile(index):
        with open(index) as f:
            if "macroarch" in json.load(f).get("metadata", {}):
                os.remove(index)


def save_pretrained(model: Any, directory: str | os.PathLike, *, packed: bool = False, **kwargs: Any) -> None:
    """Save an HF model under MVAS: dense weights in the training dtype (``model.save_pretrained``, loadable by
    any ``from_pretrained``), or with ``packed=True`` its config plus the packed weights (``mvas.save_packed``) under
    ``mvas.PACKED_WEIGHTS_NAME``, a ``README.md`` saying how to load them, and a ``model.safetensors.index.json``
    whose one shard, ``PACKED_STUB_SHARD``, does not exist: transformers' ``from_pretrained`` on the directory fails
    at once ("No such file or directory: .../MVAS-packed weights - load with
    macroarch.integrations.from_pretrained ..."), and ``from_pretrained`` below restores it exactly. Each form
    removes the other's weight files from ``directory`` (as transformers removes a previous save's shards), so a
    loader never finds the weights of an earlier save.

    For a plain ``state_dict`` file: ``safetensors.torch.save_file(model.state_dict(), ...)`` refuses managed weights
    ("non contiguous tensor": an ``MVASWeight`` has no dense storage to write); ``mvas.dense_state_dict(model)``
    is the dense dict to save instead, ``mvas.save_packed(model, path)`` the exact packed file."""
    directory = os.fspath(directory)
    if not packed:
        model.save_pretrained(directory, **kwargs)
        _remove_packed(directory)
        return
    os.makedirs(directory, exist_ok=True)
    _remove(directory, _DENSE_FILES)
    model.config.save_pretrained(directory)
    mvas.save_packed(model, os.path.join(directory, mvas.PACKED_WEIGHTS_NAME))
    readme = _PACKED_README.format(weights=mvas.PACKED_WEIGHTS_NAME, model_cls=type(model).__name__)
    with open(os.path.join(directory, "README.md"), "w") as f:
        f.write(readme)
    index = {"metadata": {"macroarch": f"MVAS-packed weights in {mvas.PACKED_WEIGHTS_NAME}: load this directory "
                                       "with macroarch.integrations.from_pretrained (README.md)"},
             "weight_map": dict.fromkeys(model.state_dict(), PACKED_STUB_SHARD)}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
def from_pretrained(model_cls: Any, directory: str | os.PathLike) -> tuple[Any, mvas.MVASStore]:
    """A model saved by ``save_pretrained(..., packed=True)``: built from its config (``model_cls``, e.g.
    ``LlamaForCausalLM``) in the saved dtype, put under the checkpoint's plan, weights restored bit for bit.
    Returns ``(model, store)``. A directory without packed weights (a dense save) raises ``FileNotFoundError``
    naming ``model_cls.from_pretrained``, before any model is built."""
    directory = os.fspath(directory)
    packed = os.path.join(directory, mvas.PACKED_WEIGHTS_NAME)
    if not os.path.isfile(packed):
        raise FileNotFoundError(
            f"{packed}: no MVAS-packed weights in {directory} (written by save_pretrained(model, dir, packed=True)); "
            f"a dense save loads with {getattr(model_cls, '__name__', model_cls)}.from_pretrained({directory!r}), "
            "and mvas.apply(model, plan) puts it under MVAS again")
    config = model_cls.config_class.from_pretrained(directory)
    model = model_cls(config)
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        model.to(dtype)
    store = mvas.load_packed(model, packed)
    return model, store
