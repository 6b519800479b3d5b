"""Models a plain install (torch alone, no extras) can build: PointNet, and its outputs read as HF code reads them."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch


@pytest.fixture
def pointnet(monkeypatch):
    """``macroarch.models.pointnet`` imported afresh where ``import transformers`` fails (as without the extra)."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "macroarch.models.pointnet", raising=False)
    return importlib.import_module("macroarch.models.pointnet")


def test_pointnet_trains_without_transformers(pointnet):
    torch.manual_seed(0)
    model = pointnet.PointNet(num_classes=4)
    points, labels = torch.randn(4, 64, 3), torch.tensor([0, 1, 2, 3])
    out = model(points, labels)
    out.loss.backward()
    assert out.logits.shape == (4, 4) and out.feature_transform.shape == (4, 64, 64)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_pointnet_outputs_read_as_a_model_output(pointnet):
    """By attribute, by key, by position over the fields that are set (HF Trainer takes ``outputs[0]`` as the loss
    of an output that is not a dict), ``to_tuple`` and ``dict``; without labels the logits come first."""
    model = pointnet.PointNet(num_classes=4).eval()
    points = torch.randn(2, 32, 3)
    with_loss = model(points, torch.tensor([0, 1]))
    assert with_loss[0] is with_loss.loss and with_loss["logits"] is with_loss.logits
    assert list(with_loss) == ["loss", "logits", "feature_transform"] == list(dict(with_loss))
    assert with_loss.to_tuple() == (with_loss.loss, with_loss.logits, with_loss.feature_transform)
    without = model(points)
    assert without.loss is None and "loss" not in without and len(without) == 2
    assert without[0] is without.logits and without.to_tuple()[1] is without.feature_transform
    with pytest.raises(KeyError):
        without["loss"]
