"""Stopped and resumed through HF Trainer (``MacroTrainer.resume_from_checkpoint``) and accelerate
(``save_state`` / ``load_state``, safetensors): a DGR + MVAS run, MVAS alone, and DGR + ``CompensatedAdamW`` with
bf16 weights and fp32 master copies continue bitwise as the run that was never stopped (packed or dense weights,
moments and master copies in their stored dtype and bytes, step counters, seeds, LR schedule). The resumed run is
built with other weights and other seeds: only the checkpoint can make it match."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import TrainingArguments

from macroarch import mvas
from macroarch.dgr import DGRWrapper
from macroarch.integrations import MacroTrainer, register_mvas_checkpointing
from macroarch.models import get_model_spec
from macroarch.optim import CompensatedAdamW

STOP, MORE = 3, 3
RUNS = ["dgr+mvas", "mvas", "dgr+master"]


def _model(seed, run):
    """The tiny Llama: packed by MVAS, or (``dgr+master``) in bf16 for CompensatedAdamW's fp32 master copies."""
    torch.manual_seed(seed)
    model = get_model_spec("llama_65b_tiny").scaled(n_layers=2).build()
    if "mvas" in run:
        mvas.apply(model, mvas.plan_from_rules(model, [("*mlp*", "fp4"), ("*", "fp8")], block_size=32,
                                               min_numel=1024))
    else:
        model.to(torch.bfloat16)
    return model


def _optimizer(run):
    if "mvas" in run:
        return mvas.MVASAdamW, {"lr": 1e-2}
    return CompensatedAdamW, {"lr": 1e-2, "master_weights": True}


def _data(n):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (n, 16), generator=g)]


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same_weights(a, b):
    pa, pb = mvas.packed_state_dict(a), mvas.packed_state_dict(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and torch.equal(_bits(pa[k]), _bits(pb[k])), k


def _assert_same_state(a, b, where="optimizer"):
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _stored(opt):
    """Each state tensor's kind, dtype and bytes in all: what a load that casts (moments to the parameter dtype, master
    copies to bf16) changes."""
    kinds = {}
    for state in opt.state.values():
        for key, v in state.items():
            if torch.is_tensor(v):
                dtype, nbytes = kinds.get(key, (set(), 0))
                kinds[key] = (dtype | {v.dtype}, nbytes + v.nbytes)
    return kinds


# ------------------------------------------------------------------------------------------------ HF Trainer
def _trainer(tmp_path, seed, run):
    model = _model(seed, run)
    data = _data(4 * (STOP + MORE))
    net = model
    if run.startswith("dgr"):
        net = DGRWrapper(model, group_size=1, example_inputs={k: v[None] for k, v in data[0].items()})
    args = TrainingArguments(str(tmp_path / "run"), max_steps=STOP + MORE, save_steps=STOP,
                             per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="linear",
                             use_cpu=True, report_to=[], seed=0, save_only_model=False, logging_steps=1000)
    trainer = MacroTrainer(model=net, args=args, train_dataset=data,
                           optimizer_cls_and_kwargs=_optimizer(run))  # seeds drawn at construction
    return trainer, model


@pytest.mark.parametrize("run", RUNS)
def test_macro_trainer_resume_equals_the_uninterrupted_run(tmp_path, run):
    first, model = _trainer(tmp_path, seed=0, run=run)
    first.train()
    checkpoint = tmp_path / "run" / f"checkpoint-{STOP}"
    assert (checkpoint / mvas.PACKED_WEIGHTS_NAME).is_file() == ("mvas" in run)

    second, resumed = _trainer(tmp_path, seed=1, run=run)
    second.train(resume_from_checkpoint=str(checkpoint))
    _assert_same_weights(model, resumed)
    opt, opt2 = first.optimizer.optimizer, second.optimizer.optimizer  # inside accelerate's wrapper
    assert _stored(opt2) == _stored(opt)
    if "mvas" in run:
        assert torch.float8_e4m3fn in _stored(opt2)["exp_avg"][0]
    else:
        assert _stored(opt2)["master"][0] == {torch.float32}
    _assert_same_state(opt.state_dict(), opt2.state_dict())
    assert first.lr_scheduler.state_dict() == second.lr_scheduler.state_dict()


# ------------------------------------------------------------------------------------------------ accelerate
def _accelerated(seed, run, batches):
    set_seed(seed)
    accelerator = Accelerator(cpu=True)
    register_mvas_checkpointing(accelerator)
    model = _model(seed, run)
    net = model
    cls, kwargs = _optimizer(run)
    if run.startswith("dgr"):
        first = batches[0]["input_ids"]
        net = DGRWrapper(model, group_size=1, example_inputs={"input_ids": first, "labels": first})
        opt = net.optimizer(cls, **kwargs)
    else:
        opt = cls(model.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    net, opt, sched = accelerator.prepare(net, opt, sched)
    return accelerator, model, net, opt, sched


def _steps(net, opt, sched, batches):
    for batch in batches:
        net(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("run", RUNS)
def test_accelerate_save_and_load_state_resume_exactly(tmp_path, run):
    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (STOP + MORE, 4, 16), generator=g)]
    accelerator, model, net, opt, sched = _accelerated(0, run, batches)
    _steps(net, opt, sched, batches[:STOP])
    accelerator.save_state(str(tmp_path / "state"))  # safetensors, accelerate's default
    assert (tmp_path / "state" / mvas.PACKED_WEIGHTS_NAME).is_file() == ("mvas" in run)
    stored = _stored(opt.optimizer)
    _steps(net, opt, sched, batches[STOP:])

    accelerator2, resumed, net2, opt2, sched2 = _accelerated(1, run, batches)
    accelerator2.load_state(str(tmp_path / "state"))
    assert _stored(opt2.optimizer) == stored  # moments and master copies in their stored dtype and bytes
    _steps(net2, opt2, sched2, batches[STOP:])
    _assert_same_weights(model, resumed)
    _assert_same_state(opt.optimizer.state_dict(), opt2.optimizer.state_dict())
    assert sched.state_dict() == sched2.state_dict()


def test_accelerate_load_state_without_the_packed_file_says_so(tmp_path):
    batches = [{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (1, 4, 16))]
    accelerator, _, net, opt, sched = _accelerated(0, "mvas", batches)
    accelerator.save_state(str(tmp_path / "state"))
    (tmp_path / "state" / mvas.PACKED_WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="register_mvas_checkpointing"):
        accelerator.load_state(str(tmp_path / "state"))
