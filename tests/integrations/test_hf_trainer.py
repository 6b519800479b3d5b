"""HF Trainer with MVAS, DGR and CompensatedAdamW: what the plain Trainer does, what MacroTrainer keeps right, and
that saved models load back as the same model."""

import math

import pytest
import torch
from model_zoo import TokenWindows as Tokens
from model_zoo import tiny_llama
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from macroarch import mvas
from macroarch.dgr import DGRWrapper
from macroarch.integrations import MacroTrainer, from_pretrained, save_pretrained
from macroarch.optim import CompensatedAdamW, LossSpikeGuard


def _args(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=8,
                   per_device_train_batch_size=4, logging_steps=1, save_strategy="no", disable_tqdm=True,
                   learning_rate=1e-2, lr_scheduler_type="linear", seed=0, max_grad_norm=1.0)
    return TrainingArguments(**{**options, **overrides})


def _losses(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _train(model, tmp_path, trainer_cls=Trainer, **kwargs):
    args = kwargs.pop("args", None) or _args(tmp_path)
    trainer = trainer_cls(model=model, args=args, train_dataset=Tokens(), **kwargs)
    trainer.train()
    return trainer


def test_mvas_default_optimizer_raises_and_mvas_adamw_trains_like_the_dense_model(tmp_path):
    with pytest.raises(TypeError, match="MVASAdamW"):
        _train(tiny_llama(managed=True), tmp_path)
    dense = _losses(_train(tiny_llama(), tmp_path))
    for kwargs in (lambda m: dict(optimizers=(mvas.MVASAdamW(m.parameters(), lr=1e-2, seed=0), None)),
                   lambda m: dict(optimizer_cls_and_kwargs=(mvas.MVASAdamW, dict(lr=1e-2, seed=0)),
                                  args=_args(tmp_path, activation_checkpointing=True))):  # HF's checkpointing
        model = tiny_llama(managed=True)
        losses = _losses(_train(model, tmp_path, **kwargs(model)))
        assert losses[-1] < losses[0] - 1.0
        assert losses[0] - losses[-1] > 0.7 * (dense[0] - dense[-1])  # learns about as the dense model does


def test_save_model_writes_dense_weights_that_from_pretrained_loads_as_the_same_model(tmp_path):
    model = tiny_llama(managed=True)
    trainer = _train(model, tmp_path, optimizers=(mvas.MVASAdamW(model.parameters(), lr=1e-2, seed=0), None))
    trainer.save_model(str(tmp_path / "dense"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", attn_implementation="eager")
    assert not any(isinstance(p, mvas.MVASWeight) for p in loaded.parameters())
    ids = Tokens()[0]["input_ids"][None]
    assert torch.equal(loaded(ids).logits, model(ids).logits)

    save_pretrained(model, tmp_path / "packed", packed=True)  # on request: packed, exact, refused by dense loaders
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    restored, store = from_pretrained(LlamaForCausalLM, tmp_path / "packed")
    for name in store:
        assert torch.equal(store.packed(name).payload.view(torch.uint8),
                           model.get_parameter(name).payload.view(torch.uint8))
    restored.config._attn_implementation = model.config._attn_implementation
    assert torch.equal(restored(ids).logits, model(ids).logits)


def test_dgr_under_macro_trainer_is_plain_training_with_the_real_grad_norm(tmp_path):
    args = _args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=1e6)
    plain = _train(tiny_llama(), tmp_path, args=args)
    model = tiny_llama()
    ids = Tokens()[0]["input_ids"][None]
    wrapper = DGRWrapper(model, group_size=1, example_inputs=dict(input_ids=ids, labels=ids))
    dgr = _train(wrapper, tmp_path, MacroTrainer, args=args)
    assert _losses(dgr) == pytest.approx(_losses(plain), rel=1e-4)
    assert _losses(dgr, "grad_norm") == pytest.approx(_losses(plain, "grad_norm"), rel=1e-4)
    assert _losses(dgr, "learning_rate") == _losses(plain, "learning_rate")
    for (name, a), b in zip(plain.model.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    dgr.save_model(str(tmp_path / "wrapped"))  # the wrapped model, under its own names
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "wrapped").lm_head.weight, model.lm_head.weight)

    model = tiny_llama()  # or the model itself, with the DGR optimizer given
    wrapper = DGRWrapper(model, group_size=1, example_inputs=dict(input_ids=ids, labels=ids))
    inner = _train(model, tmp_path, MacroTrainer, args=args,
                   optimizers=(wrapper.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.0), None))
    assert _losses(inner, "grad_norm") == pytest.approx(_losses(plain, "grad_norm"), rel=1e-4)


def test_dgr_clips_each_group_to_max_grad_norm(tmp_path):
    lr, max_norm = 0.5, 1e-2
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapper = DGRWrapper(model, group_size=1, loss_fn=lambda m: m(**Tokens()[0:2]).loss)
    _train(wrapper, tmp_path, MacroTrainer, optimizer_cls_and_kwargs=(torch.optim.SGD, dict(lr=lr)),
           args=_args(tmp_path, max_steps=1, max_grad_norm=max_norm, lr_scheduler_type="constant"))
    for group in wrapper.grouping:
        moved = math.sqrt(sum(float((p.detach() - before[n]).square().sum())
                              for n, p in zip(group.names, group.params)))
        assert moved <= lr * max_norm * (1 + 1e-4)


def test_plain_trainer_accepts_a_dgr_wrapper(tmp_path):
    model = tiny_llama()
    ids = Tokens()[0]["input_ids"][None]
    wrapper = DGRWrapper(model, group_size=1, example_inputs=dict(input_ids=ids, labels=ids))
    assert wrapper.config is model.config and wrapper.pipeline_config.mode == "sync"
    losses = _losses(_train(wrapper, tmp_path))  # Trainer keeps the columns the wrapped forward names
    assert losses[-1] < losses[0] - 1.0


class _InfAt(TrainerCallback):
    """An infinite gradient at one step, after clipping (as an overflow would leave it)."""

    def __init__(self, model, step):
        self.model, self.step = model, step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            next(self.model.parameters()).grad.view(-1)[0] = math.inf


def test_compensated_adamw_scale_guard_and_skipped_steps_under_macro_trainer(tmp_path):
    args = _args(tmp_path, max_grad_norm=0.5)
    plain = _train(tiny_llama(), tmp_path, args=args)
    model = tiny_llama()
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, grad_scale="norm", spike_guard=LossSpikeGuard(threshold=10))
    with pytest.raises(RuntimeError, match="no loss was scaled"):  # a plain Trainer never scales the loss
        _train(tiny_llama(), tmp_path,
               optimizers=(CompensatedAdamW(tiny_llama().parameters(), grad_scale="norm"), None))
    trainer = _train(model, tmp_path, MacroTrainer, args=args, optimizers=(opt, None))
    assert _losses(trainer, "grad_norm")[0] == pytest.approx(_losses(plain, "grad_norm")[0], rel=1e-4)  # unscaled
    assert opt.spike_guard.observations == 8 and opt.stats["updates"] == 8
    assert _losses(trainer)[-1] < _losses(trainer)[0] - 1.0

    model = tiny_llama()
    opt = CompensatedAdamW(model.parameters(), lr=1e-2)
    trainer = _train(model, tmp_path, MacroTrainer, args=args, optimizers=(opt, None), callbacks=[_InfAt(model, 3)])
    assert opt.stats["skipped_nonfinite"] == 1 and trainer.lr_scheduler.last_epoch == 7  # one step held back
    with pytest.raises(ValueError, match="Trainer accumulates gradients itself"):
        model = tiny_llama()
        _train(model, tmp_path, MacroTrainer, optimizers=(CompensatedAdamW(model.parameters(), accumulation_steps=4),
                                                          None))
