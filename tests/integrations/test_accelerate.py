"""accelerate's prepare / accumulate loop with MVAS (MVASAdamW) and DGR: it trains as the dense model does, and
accumulation under DGR is the accelerator's."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from model_zoo import even_ids, tiny_llama

from macroarch import mvas
from macroarch.dgr import DGRWrapper

STEPS, ACCUMULATION = 8, 2


def _batches():
    ids = even_ids(STEPS * ACCUMULATION * 2)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)


def _run(variant, rounding="stochastic"):
    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = tiny_llama(managed=variant != "dense")
    example = next(iter(_batches()))[0]
    if variant == "dense":
        net, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        if variant == "mvas":
            net, opt = model, mvas.MVASAdamW(model.parameters(), lr=1e-2, seed=0, rounding=rounding)
        else:  # DGR's accumulation is the accelerator's
            net = DGRWrapper(model, group_size=1, accumulation_steps=ACCUMULATION,
                             example_inputs=dict(input_ids=example, labels=example))
            opt = net.optimizer(mvas.MVASAdamW, lr=1e-2, seed=0, rounding=rounding)
    net, opt, loader = accelerator.prepare(net, opt, _batches())
    losses = []
    for (ids,) in loader:
        with accelerator.accumulate(net):
            loss = net(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model


@pytest.fixture(scope="module")
def dense():
    return _run("dense")[0]


@pytest.mark.parametrize("variant", ["mvas", "mvas+dgr"])
def test_prepare_and_accumulate_train_mvas_as_the_dense_model(variant, dense):
    losses, model = _run(variant)
    assert any(isinstance(p, mvas.MVASWeight) for p in model.parameters())
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    dense_drop = sum(dense[:4]) / 4 - sum(dense[-4:]) / 4
    assert first - last > 0.7 * dense_drop > 0


def test_mvas_and_dgr_with_mvas_are_the_same_training():
    a, b = _run("mvas", "nearest")[0], _run("mvas+dgr", "nearest")[0]  # no random draws: one optimizer or one per group
    assert a == pytest.approx(b, rel=1e-5)  # sync DGR updates each group when its gradient is complete: same steps
