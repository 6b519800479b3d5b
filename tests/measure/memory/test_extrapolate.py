"""Depth extrapolation of measured training bytes, against a measurement at the full depth."""

import pytest
import torch

from macroarch.dgr import DGRWrapper
from macroarch.measure.memory import extrapolate_by_depth, measure_training_step, training_bytes
from macroarch.models import get_model_spec
from macroarch.mvas import MVASAdamW, apply, plan_from_rules

SPEC = get_model_spec("llama_65b_tiny").scaled(n_layers=5)


def _reports(depths, prepare=None):
    return {d: measure_training_step(SPEC.scaled(n_layers=d), 2, 16, "bf16_mixed", prepare=prepare) for d in depths}


def _mvas(dgr):
    def prepare(net):
        apply(net, plan_from_rules(net, [("*mlp*", "fp4"), ("*", "fp8")], min_numel=1024))
        if not dgr:
            return net, MVASAdamW(net.parameters(), seed=0, min_state_numel=1024)
        ids = torch.randint(0, 100, (1, 8))
        wrapper = DGRWrapper(net, group_size=1, example_inputs=dict(input_ids=ids, labels=ids))
        return wrapper, wrapper.optimizer(MVASAdamW, seed=0, min_state_numel=1024)
    return prepare


@pytest.mark.parametrize("prepare", [None, _mvas(False)], ids=["adamw", "mvas"])
def test_three_depths_predict_the_full_depth_to_the_byte(prepare):
    full = training_bytes(measure_training_step(SPEC, 2, 16, "bf16_mixed", prepare=prepare))
    assert extrapolate_by_depth(_reports([1, 2, 3], prepare), 5) == full


def test_dgr_gradients_are_constant_in_depth():
    prepare = _mvas(True)
    full = training_bytes(measure_training_step(SPEC, 2, 16, "bf16_mixed", prepare=prepare))
    reports = _reports([1, 2, 3], prepare)
    assert extrapolate_by_depth(reports, 5, constant=("gradients",)) == full
    with pytest.raises(ValueError, match="gradients: bytes are not affine"):
        extrapolate_by_depth(reports, 5)


def test_one_depth_is_not_enough():
    with pytest.raises(ValueError, match="two or more depths"):
        extrapolate_by_depth(_reports([2]), 5)
