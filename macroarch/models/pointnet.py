"""PointNet for point-cloud classification (Qi et al. 2017, "PointNet: Deep Learning on Point Sets for 3D
Classification and Segmentation", figure 2 and appendix C), the model of claim C13 (post section 6).

No library ships it, so it is written here as the paper describes it:

- **input transform**: a T-Net (shared MLP 64-128-1024 over the points, max-pool, FC 512-256, a 3x3 matrix
  initialised to the identity) aligns the cloud;
- **shared MLP** 64-64, then the **feature transform** (the same T-Net predicting a 64x64 matrix), then the
  shared MLP 64-128-1024; "shared" means the same weights at every point: a 1x1 ``Conv1d``;
- **max-pool** over the points gives a 1024-d global feature, then the **head** FC 512-256-k with dropout
  (keep ratio 0.7) before the last layer;
- every layer but the last of each MLP has BatchNorm and ReLU;
- the loss is cross-entropy plus the feature-transform regulariser ``0.001 * ||I - A A^T||_F^2``.

The five layers of the shared MLP are one ``nn.ModuleList`` (``layers``), the repeated container that
``find_repeated_layers`` (and so DGR's grouping and MVAS's plan transfer) sees. ``forward(points, labels)``
takes points as ``(batch, n_points, 3)`` and returns a ``PointNetOutput`` with ``logits`` and, when labels are
given, ``loss``, read as Hugging Face code reads a ``ModelOutput``: by attribute (``out.loss``), by key
(``out["logits"]``), by position over the fields that are set (``out[0]`` is the loss when there is one, as
``Trainer`` reads it) and as ``to_tuple()``. It needs torch alone (no ``transformers``).

Deviations: none in the architecture. The paper trains with batch 32, 1024 points, Adam at 1e-3; the
experiments here choose their own settings.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: widths of the shared MLP (64-64 before the feature transform, 64-128-1024 after it)
SHARED_MLP = (64, 64, 64, 128, 1024)
#: where the feature transform sits: after this many layers of the shared MLP
FEATURE_TRANSFORM_AFTER = 2
TNET_MLP = (64, 128, 1024)
TNET_FC = (512, 256)
HEAD_FC = (512, 256)
REGULARISER_WEIGHT = 1e-3


@dataclass(eq=False)
class PointNetOutput(Mapping):
    """``logits`` (batch, classes); ``loss`` when labels were given; ``feature_transform`` (batch, 64, 64).

    A read-only mapping of the fields that are not None, in field order, like ``transformers``' ``ModelOutput``:
    ``out.logits``, ``out["logits"]``, ``out[0]``, ``out.to_tuple()``, ``dict(out)``."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    feature_transform: torch.Tensor | None = None

    def _set(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str):
            return self._set()[key]
        return self.to_tuple()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())

    def to_tuple(self) -> tuple[torch.Tensor, ...]:
        """The fields that are set, in order (``loss`` first when there is one)."""
        return tuple(self._set().values())


class PointConv(nn.Module):
    """One layer of a shared MLP: the same ``Linear(c_in, c_out)`` at every point (a 1x1 Conv1d), BatchNorm, ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size=1)
        self.norm = nn.BatchNorm1d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c_in, N) -> (B, c_out, N)
        return F.relu(self.norm(self.conv(x)))


class Dense(nn.Module):
    """A fully connected layer with BatchNorm and ReLU (the T-Nets' and the head's hidden layers)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c_in, c_out)
        self.norm = nn.BatchNorm1d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.fc(x)))


def _mlp(widths: tuple[int, ...], c_in: int, layer: type[nn.Module]) -> nn.ModuleList:
    return nn.ModuleList(layer(a, b) for a, b in zip((c_in, *widths[:-1]), widths, strict=True))


class TNet(nn.Module):
    """The transform network: a ``k x k`` matrix from the points, identity at initialisation."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.convs = _mlp(TNET_MLP, k, PointConv)
        self.fcs = _mlp(TNET_FC, TNET_MLP[-1], Dense)
        self.out = nn.Linear(TNET_FC[-1], k * k)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)  # the identity is added in forward, so the transform starts as it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, k, N) -> (B, k, k)
        for layer in self.convs:
            x = layer(x)
        x = x.amax(dim=2)  # (B, 1024): max-pool over the points
        for layer in self.fcs:
            x = layer(x)
        eye = torch.eye(self.k, dtype=x.dtype, device=x.device)
        return self.out(x).view(-1, self.k, self.k) + eye


class PointNet(nn.Module):
    """The PointNet classification network (module docstring).

    Args:
        num_classes: ``k``, the classes of the head (ModelNet40: 40).
        dropout: dropout before the last layer of the head (the paper's keep ratio 0.7 is 0.3).
    """

    def __init__(self, num_classes: int = 40, dropout: float = 0.3) -> None:
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be an int >= 2")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} must be in [0, 1)")
        self.num_classes = num_classes
        self.input_transform = TNet(3)
        self.feature_transform = TNet(SHARED_MLP[FEATURE_TRANSFORM_AFTER - 1])
        self.layers = _mlp(SHARED_MLP, 3, PointConv)
        self.head = _mlp(HEAD_FC, SHARED_MLP[-1], Dense)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(HEAD_FC[-1], num_classes)

    def forward(self, points: torch.Tensor, labels: torch.Tensor | None = None) -> PointNetOutput:
        if points.dim() != 3 or points.shape[-1] != 3:
            raise ValueError(f"points must be (batch, n_points, 3); got {tuple(points.shape)}")
        x = points.transpose(1, 2)  # (B, 3, N)
        x = torch.bmm(self.input_transform(x).transpose(1, 2), x)  # aligned points, (B, 3, N)
        a = None
        for i, layer in enumerate(self.layers):
            if i == FEATURE_TRANSFORM_AFTER:
                a = self.feature_transform(x)  # (B, 64, 64)
                x = torch.bmm(a.transpose(1, 2), x)
            x = layer(x)
        x = x.amax(dim=2)  # (B, 1024) global feature
        for layer in self.head:
            x = layer(x)
        logits = self.classifier(self.dropout(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float(), labels) + REGULARISER_WEIGHT * transform_regulariser(a)
        return PointNetOutput(loss=loss, logits=logits, feature_transform=a)


def transform_regulariser(a: torch.Tensor) -> torch.Tensor:
    """``||I - A A^T||_F^2`` averaged over the batch: keeps the feature transform close to orthogonal."""
    eye = torch.eye(a.shape[-1], dtype=torch.float32, device=a.device)
    a = a.float()
    return (eye - a @ a.transpose(1, 2)).square().sum(dim=(1, 2)).mean()


__all__ = ["PointConv", "PointNet", "PointNetOutput", "TNet", "transform_regulariser"]
