"""Synthetic, learnable datasets for the application models of claims C12-C14 (post section 6), generated with
fixed seeds (nothing is downloaded), stored under ``data/applications/`` and verified on load.

Each is small, but has a real signal the model must learn:

- ``proteins`` (ESMFold's folding trunk, C12): chains of ``length`` residues drawn from 20 types. Every type
  has a fixed bond direction (seeded); the chain's CA atoms follow those directions, 3.8 Angstrom apart, with
  a persistence term that bends the chain smoothly. The structure is a function of the sequence, so the
  distogram (binned CA-CA distances, ``macroarch.models.folding.distance_bins``) is learnable from it.
- ``pointclouds`` (PointNet, C13): ``points`` points on the surface of one of eight shapes (sphere, cube,
  cylinder, cone, torus, square, two spheres, helix), scaled per axis by 0.7-1.3, rotated about z, centred,
  normalised to the unit sphere and jittered (``noise``). The label is the shape.
- ``videos`` (TimeSformer and VideoMAE, C14): ``frames`` RGB frames of ``size`` x ``size`` pixels; a square
  moves across a noisy background in one of ``classes`` directions (4: right, left, down, up; 8: also the
  diagonals), wrapping around at the edges. The label is the direction. With ``colour_cue`` (the default) the
  square also has its direction's colour (jittered), so a single frame tells the class: tiny video transformers
  trained from scratch for a few hundred steps learn that, while motion alone takes them thousands of clips
  (``colour_cue=False``: a random colour, only motion tells).

A dataset is a function of its spec (``ProteinSpec``, ``PointCloudSpec``, ``VideoSpec``). It is written to
``<data root>/applications/<kind>-<hash of the spec>/`` (``data.npz`` and ``meta.json`` with the spec and the
file's sha256) under a temporary name and renamed, so a folder with ``meta.json`` is complete; ``load_dataset``
refuses a file whose hash does not match. ``ensure_dataset(kind, **spec)`` builds it when missing;
``data_scripts/build_application_data.py`` is the command line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from macroarch.data.text import data_root

FORMAT_VERSION = 1
N_RESIDUE_TYPES = 20
CA_DISTANCE = 3.8  # Angstrom between consecutive CA atoms
SHAPES = ("sphere", "cube", "cylinder", "cone", "torus", "square", "two_spheres", "helix")


@dataclass(frozen=True)
class ProteinSpec:
    """Chains whose structure follows from their sequence.

    Attributes:
        n: number of chains.
        length: residues per chain.
        persistence: weight of the previous bond direction in the next (0: each bond is its type's direction).
        seed: generator seed (the type directions and the sequences).
    """

    n: int = 512
    length: int = 64
    persistence: float = 0.3
    seed: int = 0


@dataclass(frozen=True)
class PointCloudSpec:
    """Point clouds of eight shapes.

    Attributes:
        n: number of clouds (classes balanced).
        points: points per cloud.
        noise: standard deviation of the jitter, after normalisation to the unit sphere.
        seed: generator seed.
    """

    n: int = 2048
    points: int = 1024
    noise: float = 0.01
    seed: int = 0


@dataclass(frozen=True)
class VideoSpec:
    """Clips of a square moving in one of ``classes`` directions.

    Attributes:
        n: number of clips (classes balanced).
        frames: frames per clip.
        size: frame height and width in pixels.
        classes: 4 (axis directions) or 8 (with the diagonals).
        speed: pixels per frame (a clip's speed is ``speed`` or twice it, at random).
        colour_cue: the square has its direction's colour (else a random one).
        seed: generator seed.
    """

    n: int = 1024
    frames: int = 8
    size: int = 32
    classes: int = 4
    speed: int = 1
    colour_cue: bool = True
    seed: int = 0


SPECS: dict[str, type] = {"proteins": ProteinSpec, "pointclouds": PointCloudSpec, "videos": VideoSpec}


# ------------------------------------------------------------------------------------------------ generators

def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def generate_proteins(spec: ProteinSpec) -> dict[str, np.ndarray]:
    """``aatype`` (n, length) int64 in 0..19 and ``coords`` (n, length, 3) float32 CA positions (Angstrom)."""
    rng = np.random.default_rng(spec.seed)
    directions = _unit(rng.normal(size=(N_RESIDUE_TYPES, 3)))
    aatype = rng.integers(0, N_RESIDUE_TYPES, size=(spec.n, spec.length))
    coords = np.zeros((spec.n, spec.length, 3))
    bond = directions[aatype[:, 0]]
    for i in range(1, spec.length):
        bond = _unit(directions[aatype[:, i]] + spec.persistence * bond)
        coords[:, i] = coords[:, i - 1] + CA_DISTANCE * bond
    return {"aatype": aatype.astype(np.int64), "coords": coords.astype(np.float32)}


def _shape_points(shape: str, m: int, rng: np.random.Generator) -> np.ndarray:
    """``m`` points on the surface of ``shape``, roughly uniform, in a box of about [-1, 1]^3."""
    u, v = rng.random(m), rng.random(m)
    if shape == "sphere":
        return _unit(rng.normal(size=(m, 3)))
    if shape == "cube":
        p = rng.uniform(-1, 1, size=(m, 3))
        face = rng.integers(0, 3, m)
        p[np.arange(m), face] = rng.choice([-1.0, 1.0], m)
        return p
    if shape == "cylinder":
        t = 2 * np.pi * u
        return np.stack([np.cos(t), np.sin(t), 2 * v - 1], axis=1)
    if shape == "cone":
        t, r = 2 * np.pi * u, np.sqrt(v)  # area grows with the radius
        return np.stack([r * np.cos(t), r * np.sin(t), 1 - 2 * r], axis=1)
    if shape == "torus":
        t, s = 2 * np.pi * u, 2 * np.pi * v
        return np.stack([(1 + 0.35 * np.cos(s)) * np.cos(t), (1 + 0.35 * np.cos(s)) * np.sin(t), 0.35 * np.sin(s)], 1)
    if shape == "square":
        return np.stack([2 * u - 1, 2 * v - 1, np.zeros(m)], axis=1)
    if shape == "two_spheres":
        p = 0.5 * _unit(rng.normal(size=(m, 3)))
        p[:, 0] += np.where(rng.random(m) < 0.5, -0.6, 0.6)
        return p
    if shape == "helix":
        t = 4 * np.pi * u
        return np.stack([np.cos(t), np.sin(t), t / (2 * np.pi) - 1], axis=1) + 0.05 * rng.normal(size=(m, 3))
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def generate_pointclouds(spec: PointCloudSpec) -> dict[str, np.ndarray]:
    """``points`` (n, points, 3) float32 and ``labels`` (n,) int64, the index of the shape in ``SHAPES``."""
    rng = np.random.default_rng(spec.seed)
    labels = np.arange(spec.n) % len(SHAPES)
    rng.shuffle(labels)
    clouds = np.empty((spec.n, spec.points, 3))
    for i, label in enumerate(labels):
        p = _shape_points(SHAPES[label], spec.points, rng) * rng.uniform(0.7, 1.3, size=3)
        a = rng.uniform(0, 2 * np.pi)
        rot = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
        p = (p @ rot.T) - p.mean(axis=0)
        clouds[i] = p / np.linalg.norm(p, axis=1).max() + spec.noise * rng.normal(size=p.shape)
    return {"points": clouds.astype(np.float32), "labels": labels.astype(np.int64)}


_DIRECTIONS = ((0, 1), (0, -1), (1, 0), (-1, 0), (1, 1), (1, -1), (-1, 1), (-1, -1))  # (down, right) steps
_PALETTE = np.array([(230, 60, 60), (60, 230, 60), (60, 60, 230), (230, 230, 60), (230, 60, 230), (60, 230, 230),
                     (230, 150, 60), (150, 60, 230)])


def generate_videos(spec: VideoSpec) -> dict[str, np.ndarray]:
    """``clips`` (n, frames, 3, size, size) uint8 and ``labels`` (n,) int64, the direction of motion."""
    if spec.classes not in (4, 8):
        raise ValueError(f"classes={spec.classes} must be 4 or 8")
    rng = np.random.default_rng(spec.seed)
    labels = np.arange(spec.n) % spec.classes
    rng.shuffle(labels)
    side = max(2, spec.size // 4)
    clips = rng.integers(0, 40, size=(spec.n, spec.frames, 3, spec.size, spec.size), dtype=np.uint8)
    rows, cols = np.arange(side), np.arange(side)
    for i, label in enumerate(labels):
        dy, dx = _DIRECTIONS[label]
        speed = spec.speed * rng.integers(1, 3)
        y0, x0 = rng.integers(0, spec.size, size=2)
        if spec.colour_cue:  # one primary-ish colour per direction, jittered
            colour = np.clip(_PALETTE[label] + rng.integers(-25, 26, size=3), 0, 255).astype(np.uint8)
        else:
            colour = rng.integers(120, 256, size=3, dtype=np.uint8)
        for t in range(spec.frames):
            ys = (y0 + speed * dy * t + rows) % spec.size
            xs = (x0 + speed * dx * t + cols) % spec.size
            clips[i, t][:, ys[:, None], xs[None, :]] = colour[:, None, None]
    return {"clips": clips, "labels": labels.astype(np.int64)}


GENERATORS: dict[str, Callable[[Any], dict[str, np.ndarray]]] = {
    "proteins": generate_proteins, "pointclouds": generate_pointclouds, "videos": generate_videos,
}


# ------------------------------------------------------------------------------------------------ files

def make_spec(kind: str, **spec: Any) -> Any:
    """The spec dataclass of ``kind`` from keywords; an unknown kind or key is a ValueError that names it."""
    if kind not in SPECS:
        raise ValueError(f"unknown dataset kind {kind!r}; known: {', '.join(SPECS)}")
    fields = {f.name for f in dataclasses.fields(SPECS[kind])}
    unknown = sorted(set(spec) - fields)
    if unknown:
        raise ValueError(f"{kind}: unknown setting(s) {unknown}; known: {sorted(fields)}")
    return SPECS[kind](**spec)


def dataset_dir(kind: str, root: str | os.PathLike | None = None, **spec: Any) -> Path:
    """``<root>/<kind>-<hash>/``: where the dataset of this spec lives (root: ``<data root>/applications``)."""
    params = dataclasses.asdict(make_spec(kind, **spec))
    digest = hashlib.sha256(json.dumps({"kind": kind, "version": FORMAT_VERSION, **params},
                                       sort_keys=True).encode()).hexdigest()[:12]
    base = Path(root).expanduser().resolve() if root is not None else data_root() / "applications"
    return base / f"{kind}-{digest}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_dataset(kind: str, root: str | os.PathLike | None = None, **spec: Any) -> Path:
    """Generate the dataset and write it (module docstring); returns its folder. Rebuilds an existing one."""
    spec_obj = make_spec(kind, **spec)
    out = dataset_dir(kind, root, **spec)
    arrays = GENERATORS[kind](spec_obj)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.partial"
    tmp.mkdir(parents=True)
    try:
        np.savez(tmp / "data.npz", **arrays)
        meta = {"kind": kind, "format_version": FORMAT_VERSION, "spec": dataclasses.asdict(spec_obj),
                "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in arrays.items()},
                "sha256": _sha256(tmp / "data.npz")}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def ensure_dataset(kind: str, root: str | os.PathLike | None = None, **spec: Any) -> Path:
    """The folder of the dataset of this spec, built first if it does not exist."""
    out = dataset_dir(kind, root, **spec)
    return out if (out / "meta.json").is_file() else build_dataset(kind, root, **spec)


def load_dataset(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The arrays of a built dataset as tensors, after checking the file's sha256 against ``meta.json``."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"no dataset at {str(path)!r} (no meta.json): build it with ensure_dataset() or "
                         "data_scripts/build_application_data.py")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    if _sha256(path / "data.npz") != meta["sha256"]:
        raise ValueError(f"{path / 'data.npz'}: sha256 differs from meta.json; delete the folder and rebuild it")
    with np.load(path / "data.npz") as data:
        return {k: torch.from_numpy(data[k].copy()) for k in data.files}


__all__ = [
    "SHAPES",
    "PointCloudSpec",
    "ProteinSpec",
    "VideoSpec",
    "build_dataset",
    "dataset_dir",
    "ensure_dataset",
    "generate_pointclouds",
    "generate_proteins",
    "generate_videos",
    "load_dataset",
    "make_spec",
]
