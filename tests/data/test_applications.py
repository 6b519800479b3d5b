"""The synthetic application datasets: deterministic, verified on load, and carrying the signal they claim."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from macroarch.data.applications import (
    CA_DISTANCE,
    SHAPES,
    PointCloudSpec,
    ProteinSpec,
    VideoSpec,
    build_dataset,
    dataset_dir,
    ensure_dataset,
    generate_pointclouds,
    generate_proteins,
    generate_videos,
    load_dataset,
)


def test_proteins_follow_their_sequence():
    data = generate_proteins(ProteinSpec(n=8, length=20, persistence=0.0, seed=3))
    steps = np.diff(data["coords"], axis=1)
    assert np.allclose(np.linalg.norm(steps, axis=-1), CA_DISTANCE, atol=1e-4)
    # with no persistence each bond is its residue type's direction: equal types, equal bonds
    types = data["aatype"][:, 1:].ravel()
    bonds = steps.reshape(-1, 3)
    for t in np.unique(types)[:5]:
        assert np.allclose(bonds[types == t], bonds[types == t][0], atol=1e-4)


def test_pointclouds_are_normalised_balanced_shapes():
    data = generate_pointclouds(PointCloudSpec(n=32, points=128, noise=0.0, seed=1))
    assert data["points"].shape == (32, 128, 3)
    assert np.allclose(np.linalg.norm(data["points"], axis=-1).max(axis=1), 1.0, atol=1e-5)
    assert np.bincount(data["labels"], minlength=len(SHAPES)).tolist() == [4] * len(SHAPES)
    planes = data["points"][data["labels"] == SHAPES.index("square")]
    assert np.allclose(planes[..., 2], planes[..., 2].mean(axis=1, keepdims=True), atol=1e-5)  # flat in z


def test_video_label_is_the_motion():
    data = generate_videos(VideoSpec(n=16, frames=4, size=16, classes=4, seed=2))
    clips, labels = data["clips"].astype(np.int64), data["labels"]
    # the square is the bright pixels (background < 40); it moves by the label's direction, 1 or 2 px per frame
    for clip, label in zip(clips, labels):
        bright = [{tuple(p) for p in np.argwhere(frame.max(axis=0) >= 120)} for frame in clip]
        dy, dx = [(0, 1), (0, -1), (1, 0), (-1, 0)][label]
        assert any({((y + k * dy) % 16, (x + k * dx) % 16) for y, x in bright[0]} == bright[1] for k in (1, 2))
    with pytest.raises(ValueError, match="classes"):
        generate_videos(VideoSpec(classes=3))


def test_build_load_and_hash(tmp_path):
    a = build_dataset("videos", tmp_path, n=8, frames=2, size=8)
    assert a == dataset_dir("videos", tmp_path, n=8, frames=2, size=8)
    assert ensure_dataset("videos", tmp_path, n=8, frames=2, size=8) == a  # found, not rebuilt
    assert dataset_dir("videos", tmp_path, n=8, frames=2, size=8, seed=1) != a
    first = load_dataset(a)
    again = load_dataset(build_dataset("videos", tmp_path, n=8, frames=2, size=8))
    assert all(torch.equal(first[k], again[k]) for k in first)
    (a / "data.npz").write_bytes((a / "data.npz").read_bytes()[:-10] + b"0" * 10)
    with pytest.raises(ValueError, match="sha256"):
        load_dataset(a)
    with pytest.raises(ValueError, match="no dataset"):
        load_dataset(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown dataset kind"):
        build_dataset("audio", tmp_path)
    with pytest.raises(ValueError, match="unknown setting"):
        build_dataset("videos", tmp_path, frame=2)
