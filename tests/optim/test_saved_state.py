"""macroarch.optim.saved_state.check_saved_state: another model's optimizer state (same number of parameters, other
shapes) is found before torch's loader writes anything, for CompensatedAdamW's and MasterWeightAdamW's state."""

import pytest
import torch
from torch import nn

from macroarch.optim import CompensatedAdamW, MasterWeightAdamW
from macroarch.optim.saved_state import check_saved_state, saved_pairs

FLOAT_STATE = ("master", "exp_avg", "exp_avg_sq", "grad_accum")


def _stepped(cls, width, **kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, width)).to(torch.bfloat16)
    opt = cls(net.parameters(), lr=1e-2, **kwargs)
    net(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    return opt


@pytest.mark.parametrize(("cls", "kwargs"), [(CompensatedAdamW, {"master_weights": True}), (MasterWeightAdamW, {})])
def test_a_wider_models_state_is_named_and_its_own_passes(cls, kwargs):
    narrow, wide = _stepped(cls, 8, **kwargs), _stepped(cls, 32, **kwargs)
    check_saved_state(narrow, narrow.state_dict(), FLOAT_STATE)
    with pytest.raises(ValueError, match=r"parameter 0: master \(32, 16\), the parameter \(8, 16\).*parameter 1: "
                                         r".*nothing was loaded"):
        check_saved_state(narrow, wide.state_dict(), FLOAT_STATE)


def test_the_layout_is_checked_first():
    opt = _stepped(CompensatedAdamW, 8)
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="hold \\[1\\] parameters, this optimizer's \\[2\\]"):
        check_saved_state(opt, {**saved, "param_groups": [{**saved["param_groups"][0], "params": [0]}]}, FLOAT_STATE)
    with pytest.raises(ValueError, match="no 'state' and 'param_groups'"):
        check_saved_state(opt, {"state": {}}, FLOAT_STATE)
    bad = {**saved, "state": {0: {**saved["state"][0], "step": torch.zeros(3)}, 1: saved["state"][1]}}
    with pytest.raises(ValueError, match=r"parameter 0: step has shape \(3,\)"):
        check_saved_state(opt, bad, FLOAT_STATE)
    assert [i for i, _, _ in saved_pairs(opt, saved)] == [0, 1]


@pytest.mark.parametrize(("cls", "kwargs"), [(CompensatedAdamW, {"master_weights": True}), (MasterWeightAdamW, {})])
def test_load_state_dict_refuses_a_wider_models_state_before_anything_changes(cls, kwargs):
    narrow, wide = _stepped(cls, 8, **kwargs), _stepped(cls, 32, **kwargs)
    before = {k: v.clone() for s in narrow.state.values() for k, v in s.items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match=r"parameter 0: master \(32, 16\), the parameter \(8, 16\)"):
        narrow.load_state_dict(wide.state_dict())
    after = {k: v for s in narrow.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
