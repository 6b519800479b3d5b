"""Other libraries' misleading messages on macroarch's objects, each reproduced first, then the message or warning
that names the fix, and the fix working: HF Trainer with DGR, safetensors and ``from_pretrained`` with MVAS."""

import inspect
import math
import warnings

import pytest
import safetensors.torch
import torch
from model_zoo import TokenWindows as Tokens
from model_zoo import tiny_llama
from torch import nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Trainer, TrainingArguments

from macroarch import mvas
from macroarch.dgr import DGRWrapper
from macroarch.integrations import MacroTrainer, from_pretrained, save_pretrained

PLAIN_TRAINER = "(transformers.Trainer) is training with a DGR optimizer"
PLAIN_TRAINER_OWN = "(transformers.Trainer) is training a DGRWrapper with an optimizer of its own"


def _args(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=2,
                   per_device_train_batch_size=4, logging_steps=1, save_strategy="no", disable_tqdm=True,
                   learning_rate=1e-2, seed=0, max_grad_norm=1.0)
    return TrainingArguments(**{**options, **overrides})


def _wrapped(**kwargs):
    model = tiny_llama()
    ids = Tokens(16)[0]["input_ids"][None]
    return model, DGRWrapper(model, group_size=1, example_inputs=dict(input_ids=ids, labels=ids), **kwargs)


def _train(trainer_cls, model, tmp_path, **kwargs):
    args = kwargs.pop("args", None) or _args(tmp_path)
    trainer = trainer_cls(model=model, args=args, train_dataset=Tokens(16), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [str(w.message) for w in caught]


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


class _AnyArgs(nn.Module):
    """A wrapper whose forward is ``(*args, **kwargs)``, as ``DGRWrapper.forward`` was."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_plain_trainer_keeps_the_wrapped_models_columns_and_warns_once_naming_macro_trainer(tmp_path):
    with pytest.raises(ValueError, match="batch received was empty.*args,kwargs"):  # HF's message for (*args, **kwargs)
        _train(Trainer, _AnyArgs(tiny_llama()), tmp_path)

    model, wrapper = _wrapped()  # no optimizer given: Trainer builds its own over the wrapper, DGR does nothing
    assert inspect.signature(wrapper.forward) == inspect.signature(model.forward)
    trainer, caught = _train(Trainer, wrapper, tmp_path)  # remove_unused_columns=True, Trainer's default
    assert len(_logged(trainer, "loss")) == 2 and not wrapper.has_optimizer
    (message,) = [m for m in caught if PLAIN_TRAINER_OWN in m]  # once, at the first forward
    assert "DGR updates nothing" in message and "macroarch.integrations.MacroTrainer" in message

    model, wrapper = _wrapped()  # the DGR optimizer given: DGR steps, Trainer's clipping and norm see nothing
    trainer, caught = _train(Trainer, wrapper, tmp_path, optimizers=(wrapper.optimizer(torch.optim.AdamW, lr=1e-2),
                                                                     None))
    assert _logged(trainer, "grad_norm") == [0.0, 0.0]  # what it silently did before
    (message,) = [m for m in caught if PLAIN_TRAINER in m]  # once, at the first step
    assert "max_grad_norm=1.0" in message and "macroarch.integrations.MacroTrainer" in message
    assert not [m for m in caught if PLAIN_TRAINER_OWN in m]

    model, wrapper = _wrapped()  # the plain model, with the DGR optimizer given: the same warning
    optimizer = wrapper.optimizer(torch.optim.AdamW, lr=1e-2)
    trainer, caught = _train(Trainer, model, tmp_path, args=_args(tmp_path, max_grad_norm=0.0),
                             optimizers=(optimizer, None))
    (message,) = [m for m in caught if PLAIN_TRAINER in m]
    assert "clips nothing" not in message and "grad_norm it logs is 0" in message  # no clipping was asked for


def test_macro_trainer_does_not_warn_about_itself_and_states_the_per_group_clipping_bound(tmp_path):
    model, wrapper = _wrapped()
    groups = len(wrapper.grouping)
    assert groups > 1
    trainer, caught = _train(MacroTrainer, wrapper, tmp_path, args=_args(tmp_path, max_grad_norm=0.5))
    assert not [m for m in caught if PLAIN_TRAINER in m or PLAIN_TRAINER_OWN in m]
    assert _logged(trainer, "grad_norm")[0] > 0
    (message,) = [m for m in caught if "under DGR clips each of the" in m]
    assert f"each of the {groups} groups'" in message and f"{0.5 * math.sqrt(groups):.3g}" in message

    model, wrapper = _wrapped(max_grad_norm=2.0)  # the wrapper's own norm wins, and the warning says so
    _, caught = _train(MacroTrainer, wrapper, tmp_path, args=_args(tmp_path, max_grad_norm=0.5))
    (message,) = [m for m in caught if "under DGR clips each of the" in m]
    assert f"{groups} groups keep the max_grad_norm DGRWrapper gave them (2.0)" in message

    model, wrapper = _wrapped()  # no clipping asked for: nothing to warn about
    _, caught = _train(MacroTrainer, wrapper, tmp_path, args=_args(tmp_path, max_grad_norm=0.0))
    assert not [m for m in caught if "under DGR clips" in m or PLAIN_TRAINER in m or PLAIN_TRAINER_OWN in m]


def test_wrapper_forward_is_still_assignable_and_bound():
    model, wrapper = _wrapped()
    ids = Tokens(16)[0]["input_ids"][None]
    assert wrapper.forward.__self__ is wrapper and DGRWrapper.forward is wrapper.forward.__func__
    expected = model(input_ids=ids).logits
    assert torch.equal(wrapper(input_ids=ids).logits, expected)
    wrapper.forward = lambda **kwargs: "replaced"  # as accelerate's mixed precision does
    assert wrapper(input_ids=ids) == "replaced"


def test_safetensors_refuses_mvas_state_dict_and_dense_state_dict_is_the_file_to_save(tmp_path):
    model = tiny_llama(managed=True)
    with pytest.raises(ValueError, match="non contiguous tensor"):  # safetensors' message: managed weights
        safetensors.torch.save_file(model.state_dict(), tmp_path / "model.safetensors")

    safetensors.torch.save_file(mvas.dense_state_dict(model), tmp_path / "model.safetensors")
    dense = tiny_llama()
    dense.load_state_dict(safetensors.torch.load_file(tmp_path / "model.safetensors"))
    ids = Tokens(16)[0]["input_ids"][None]
    assert torch.equal(dense(ids).logits, model(ids).logits)  # the values the managed model computes with

    mvas.save_packed(model, tmp_path / "packed.safetensors")  # or exact, packed
    restored = tiny_llama()
    mvas.load_packed(restored, tmp_path / "packed.safetensors")
    assert torch.equal(restored(ids).logits, model(ids).logits)


def test_a_packed_directory_says_how_to_load_it_and_a_dense_one_says_it_is_dense(tmp_path):
    model = tiny_llama(managed=True)
    save_pretrained(model, tmp_path / "packed", packed=True)
    with pytest.raises(OSError, match="load with macroarch.integrations.from_pretrained"):  # the fix, named
        AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    readme = (tmp_path / "packed" / "README.md").read_text()
    assert mvas.PACKED_WEIGHTS_NAME in readme and "from_pretrained(LlamaForCausalLM, " in readme
    restored, _ = from_pretrained(LlamaForCausalLM, tmp_path / "packed")  # what the README says works
    restored.config._attn_implementation = model.config._attn_implementation
    ids = Tokens(16)[0]["input_ids"][None]
    assert torch.equal(restored(ids).logits, model(ids).logits)

    save_pretrained(model, tmp_path / "dense")
    with pytest.raises(FileNotFoundError, match=r"LlamaForCausalLM\.from_pretrained"):
        from_pretrained(LlamaForCausalLM, tmp_path / "dense")


def test_the_first_step_check_lives_beside_other_step_hooks_and_is_silent_outside_trainer():
    model, wrapper = _wrapped()
    optimizer = wrapper.optimizer(torch.optim.SGD, lr=1e-2)
    calls = []
    optimizer.register_step_pre_hook(lambda *args: calls.append(1))  # after DGR's own check
    ids = Tokens(16)[0]["input_ids"][None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning in a plain loop
        for _ in range(2):
            wrapper(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert calls == [1, 1]
