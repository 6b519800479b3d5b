"""PointNet (Qi et al. 2017) as macroarch.models.pointnet builds it: sizes from the paper, the invariances the
architecture guarantees, the regulariser's formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from macroarch.models import find_repeated_layers
from macroarch.models.pointnet import PointNet, transform_regulariser


def _expected_parameters(k: int) -> int:
    """Counted from the paper's figure 2 and appendix C, independently of the module tree."""
    def conv(a, b):  # 1x1 conv with bias + BatchNorm (weight, bias)
        return a * b + b + 2 * b

    def fc(a, b, norm=True):
        return a * b + b + (2 * b if norm else 0)

    def tnet(d):
        return conv(d, 64) + conv(64, 128) + conv(128, 1024) + fc(1024, 512) + fc(512, 256) + fc(256, d * d, False)

    shared = conv(3, 64) + conv(64, 64) + conv(64, 64) + conv(64, 128) + conv(128, 1024)
    return tnet(3) + tnet(64) + shared + fc(1024, 512) + fc(512, 256) + fc(256, k, False)


def test_sizes_match_the_paper():
    model = PointNet(num_classes=40)
    assert sum(p.numel() for p in model.parameters()) == _expected_parameters(40)  # about 3.5M
    widths = [layer.conv.out_channels for layer in model.layers]
    assert widths == [64, 64, 64, 128, 1024]
    assert [name for name, _ in find_repeated_layers(model)] == [f"layers.{i}" for i in range(5)]


def test_forward_loss_and_transforms_start_at_identity():
    torch.manual_seed(0)
    model = PointNet(num_classes=5)
    points = torch.randn(4, 100, 3)
    out = model(points, labels=torch.tensor([0, 1, 2, 3]))
    assert out.logits.shape == (4, 5) and out.loss.ndim == 0 and torch.isfinite(out.loss)
    # the T-Nets' last layers are zero at initialisation: the feature transform is the identity
    assert torch.equal(out.feature_transform, torch.eye(64).expand(4, 64, 64))
    assert model(points).loss is None
    with pytest.raises(ValueError, match="batch, n_points, 3"):
        model(torch.randn(4, 3, 100))
    with pytest.raises(ValueError, match="num_classes"):
        PointNet(num_classes=1)


def test_logits_do_not_depend_on_the_order_of_the_points():
    torch.manual_seed(0)
    model = PointNet(num_classes=7).eval()
    for layer in (model.input_transform.out, model.feature_transform.out):  # non-trivial transforms
        nn.init.normal_(layer.weight, std=0.01)
    points = torch.randn(3, 64, 3)
    shuffled = points[:, torch.randperm(64)]
    with torch.no_grad():
        assert torch.allclose(model(points).logits, model(shuffled).logits, atol=1e-5)


def test_regulariser_is_the_frobenius_distance_from_orthogonal():
    q, _ = torch.linalg.qr(torch.randn(2, 8, 8))
    assert transform_regulariser(q).item() == pytest.approx(0.0, abs=1e-9)
    a = torch.randn(3, 8, 8)
    expected = sum(((torch.eye(8) - m @ m.T) ** 2).sum() for m in a) / 3
    assert transform_regulariser(a).item() == pytest.approx(expected.item(), rel=1e-5)


def test_learns_to_tell_a_sphere_from_a_plane():
    torch.manual_seed(0)
    model = PointNet(num_classes=2)
    sphere = nn.functional.normalize(torch.randn(16, 64, 3), dim=-1)
    plane = torch.cat([torch.rand(16, 64, 2) * 2 - 1, torch.zeros(16, 64, 1)], dim=-1)
    x, y = torch.cat([sphere, plane]), torch.cat([torch.zeros(16), torch.ones(16)]).long()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(15):
        loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
