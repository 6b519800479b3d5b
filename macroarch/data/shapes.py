"""Rendered scenes of coloured shapes with captions, for a small CLIP trained for real (claim C15), and their
verified loader.

No image-text data ships with this project and nothing may be downloaded, so the data is generated: each
scene holds one to ``max_objects`` objects, each with a colour, a shape, a size and a position (one of the
four quadrants, no two objects in one), drawn by PIL at ``supersample`` times the image size and
box-downsampled (smooth edges), with a little jitter of place, size and colour and a dark background of random
grey. Its caption comes from a small grammar::

    [a picture of | there is] a large red circle (at | in) the top left (and | with) a small blue cross ...

objects in reading order (top left, top right, bottom left, bottom right). Tokens are the grammar's words
(``VOCAB``: ``<pad>`` = 0, ``<sot>`` first, ``<eot>`` last, so that open_clip's text tower, which pools at the
largest token id, pools at the end of the caption).

Held-out combinations: ``held_out`` (colour, shape) pairs (default: colour *i* with shape *i* mod 5, eight of
the forty pairs, so every colour and every shape still occurs in training) never occur in ``train`` or
``val``; every scene of ``heldout`` has at least one object with such a pair. Retrieval on ``heldout`` is then
zero-shot for those combinations. Two captions describe the same scene when their scenes are equal
(``scene_key``), whatever the wording: ``scene_ids`` number the distinct scenes of a split, so retrieval
counts a caption of an equal scene as a hit.

A build is a function of :class:`ShapesSpec` only (``numpy`` generators seeded by ``seed`` and the split's
index): the same spec gives byte-identical files and the same ``dataset_hash``. Output in
``<data_root>/shapes/<name>/``: per split ``<split>_images.npy`` (uint8, N x H x W x 3), ``<split>_tokens.npy``
(uint8, N x context_length) and ``<split>_scenes.json`` (captions and objects); ``meta.json`` holds the spec,
the vocabulary, each file's sha256 and ``dataset_hash``. The folder is written under a temporary name and
renamed, so a folder with a ``meta.json`` is complete; :func:`load_shapes` checks every hash.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from macroarch.data.text import data_root

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 90, 235), "yellow": (230, 215, 40),
    "purple": (150, 60, 210), "orange": (245, 140, 30), "white": (235, 235, 235), "cyan": (40, 205, 215),
}
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
SIZES = ("small", "large")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
SPLITS = ("train", "val", "heldout")
PREFIXES = ("", "a picture of", "there is")
PREPOSITIONS = ("at", "in")
CONNECTORS = ("and", "with")
PAD, SOT, EOT = "<pad>", "<sot>", "<eot>"
_WORDS = sorted({w for text in (*COLOURS, *SHAPES, *SIZES, *POSITIONS, *PREFIXES, *PREPOSITIONS, *CONNECTORS,
                                "a the") for w in text.split()})
VOCAB = (PAD, SOT, *_WORDS, EOT)
"""The token vocabulary: ``<pad>`` = 0, ``<sot>``, the grammar's words (sorted), ``<eot>`` the largest id."""
_IDS = {w: i for i, w in enumerate(VOCAB)}
FORMAT_VERSION = 1


def default_held_out() -> tuple[tuple[str, str], ...]:
    """Colour *i* with shape *i* mod 5: one held-out shape per colour, each shape held out with 1-2 colours."""
    return tuple((c, SHAPES[i % len(SHAPES)]) for i, c in enumerate(COLOURS))


class ShapesError(RuntimeError):
    """A dataset folder that is missing, incomplete or does not match its ``meta.json``."""


@dataclass(frozen=True)
class ShapesSpec:
    """What a shapes dataset is built from; recorded in ``meta.json`` as ``params``."""

    image_size: int = 32
    """Side of the square images, in pixels (a multiple of 2: the quadrants)."""
    n_train: int = 20000
    """Scenes in ``train`` (seen combinations only)."""
    n_val: int = 512
    """Scenes in ``val``: seen combinations, new scenes (in-distribution retrieval)."""
    n_heldout: int = 512
    """Scenes in ``heldout``: each has at least one object with a held-out (colour, shape) pair."""
    max_objects: int = 3
    """Objects per scene are uniform in ``1..max_objects`` (at most 4: one per quadrant)."""
    held_out: tuple[tuple[str, str], ...] = field(default_factory=default_held_out)
    """(colour, shape) pairs that never occur in ``train`` or ``val``."""
    seed: int = 0
    """Seed of every random choice (scenes, wording, jitter)."""
    supersample: int = 4
    """Scenes are drawn at this multiple of ``image_size`` and downsampled (the mean of each block)."""
    context_length: int = 32
    """Tokens per caption (``<sot>`` ... ``<eot>`` then padding)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "held_out", tuple(tuple(p) for p in self.held_out))
        for name in ("image_size", "n_train", "n_val", "n_heldout", "max_objects", "supersample", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.image_size < 8 or self.image_size % 2:
            raise ValueError(f"image_size: expected an even number >= 8, got {self.image_size}")
        if self.max_objects > len(POSITIONS):
            raise ValueError(f"max_objects: at most {len(POSITIONS)} (one object per quadrant), got {self.max_objects}")
        for pair in self.held_out:
            if len(pair) != 2 or pair[0] not in COLOURS or pair[1] not in SHAPES:
                raise ValueError(f"held_out: {pair!r} is not a (colour, shape) pair of {list(COLOURS)} x "
                                 f"{list(SHAPES)}")
        if not self.held_out or len(set(self.held_out)) == len(COLOURS) * len(SHAPES):
            raise ValueError("held_out: give at least one pair and leave at least one for training")
        longest = 2 + 3 + 8 * self.max_objects + (self.max_objects - 1)  # sot, prefix, objects, connectors, eot
        if self.context_length < longest:
            raise ValueError(f"context_length: {self.context_length} < {longest}, the longest caption with "
                             f"max_objects={self.max_objects}")

    def params(self) -> dict[str, Any]:
        """The spec as JSON values; two specs build the same dataset iff these match."""
        return {"image_size": self.image_size, "n_train": self.n_train, "n_val": self.n_val,
                "n_heldout": self.n_heldout, "max_objects": self.max_objects,
                "held_out": [list(p) for p in self.held_out], "seed": self.seed, "supersample": self.supersample,
                "context_length": self.context_length, "format_version": FORMAT_VERSION}

    def size(self, split: str) -> int:
        return {"train": self.n_train, "val": self.n_val, "heldout": self.n_heldout}[split]


@dataclass(frozen=True)
class ShapeObject:
    colour: str
    shape: str
    size: str
    position: str


Scene = tuple[ShapeObject, ...]


# ------------------------------------------------------------------------------------------------ scenes
def sample_scene(rng: np.random.Generator, spec: ShapesSpec, split: str) -> Scene:
    """One scene of ``split``: objects in distinct quadrants, in reading order; held-out pairs as the module says."""
    held = set(spec.held_out)
    seen = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in held]
    n = int(rng.integers(1, spec.max_objects + 1))
    places = sorted(rng.choice(len(POSITIONS), size=n, replace=False).tolist())
    forced = int(rng.integers(n)) if split == "heldout" else -1
    objects = []
    for i, place in enumerate(places):
        if i == forced:
            colour, shape = spec.held_out[int(rng.integers(len(spec.held_out)))]
        elif split == "heldout":  # the other objects of a held-out scene: any pair
            colour, shape = list(COLOURS)[int(rng.integers(len(COLOURS)))], SHAPES[int(rng.integers(len(SHAPES)))]
        else:
            colour, shape = seen[int(rng.integers(len(seen)))]
        objects.append(ShapeObject(colour, shape, SIZES[int(rng.integers(len(SIZES)))], POSITIONS[place]))
    return tuple(objects)


def scene_key(scene: Scene) -> str:
    """The scene's canonical description: equal keys, equal scenes (whatever the caption's wording)."""
    return "; ".join(f"{o.size} {o.colour} {o.shape} {o.position}" for o in scene)


def caption(scene: Scene, rng: np.random.Generator) -> str:
    """A caption of ``scene`` from the grammar (the module docstring), wording drawn from ``rng``."""
    phrases = [f"a {o.size} {o.colour} {o.shape} {PREPOSITIONS[int(rng.integers(len(PREPOSITIONS)))]} the "
               f"{o.position}" for o in scene]
    text = phrases[0]
    for p in phrases[1:]:
        text += f" {CONNECTORS[int(rng.integers(len(CONNECTORS)))]} {p}"
    prefix = PREFIXES[int(rng.integers(len(PREFIXES)))]
    return f"{prefix} {text}" if prefix else text


def tokenize(text: str, context_length: int = 32) -> list[int]:
    """``<sot>`` + the words' ids + ``<eot>``, padded with ``<pad>`` (0) to ``context_length``."""
    words = text.split()
    unknown = [w for w in words if w not in _IDS or w in (PAD, SOT, EOT)]
    if unknown:
        raise ValueError(f"tokenize: {unknown[0]!r} is not a word of the grammar")
    ids = [_IDS[SOT], *(_IDS[w] for w in words), _IDS[EOT]]
    if len(ids) > context_length:
        raise ValueError(f"tokenize: {len(ids)} tokens do not fit context_length={context_length}")
    return ids + [_IDS[PAD]] * (context_length - len(ids))


def detokenize(ids: Any) -> str:
    """The words of a token row, without ``<sot>``, ``<eot>`` and padding."""
    return " ".join(VOCAB[int(i)] for i in ids if VOCAB[int(i)] not in (PAD, SOT, EOT))


def _outline(shape: str, cx: float, cy: float, r: float) -> tuple[str, Any]:
    """PIL drawing call and coordinates of a shape of half-side ``r`` centred at (cx, cy)."""
    if shape == "circle":
        return "ellipse", [cx - r, cy - r, cx + r, cy + r]
    if shape == "square":
        s = r * 0.85
        return "rectangle", [cx - s, cy - s, cx + s, cy + s]
    if shape == "triangle":
        return "polygon", [(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)]
    if shape == "diamond":
        return "polygon", [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    w = r * 0.38  # cross: a plus sign of two bars
    return "polygon", [(cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w), (cx + r, cy + w),
                       (cx + w, cy + w), (cx + w, cy + r), (cx - w, cy + r), (cx - w, cy + w), (cx - r, cy + w),
                       (cx - r, cy - w), (cx - w, cy - w)]


def render(scene: Scene, spec: ShapesSpec, rng: np.random.Generator) -> np.ndarray:
    """The scene as an ``image_size`` x ``image_size`` x 3 uint8 array (jitter drawn from ``rng``)."""
    from PIL import Image, ImageDraw

    big = spec.image_size * spec.supersample
    grey = int(rng.integers(0, 48))
    image = Image.new("RGB", (big, big), (grey, grey, grey))
    draw = ImageDraw.Draw(image)
    cell = big / 2
    for o in scene:
        row, col = divmod(POSITIONS.index(o.position), 2)
        half = cell * (0.36 if o.size == "large" else 0.2) * float(rng.uniform(0.9, 1.1))
        slack = cell / 2 - half - 1
        cx = (col + 0.5) * cell + float(rng.uniform(-slack, slack)) * 0.6
        cy = (row + 0.5) * cell + float(rng.uniform(-slack, slack)) * 0.6
        jitter = rng.integers(-18, 19, size=3).tolist()
        colour = tuple(min(255, max(0, v + d)) for v, d in zip(COLOURS[o.colour], jitter))
        kind, xy = _outline(o.shape, cx, cy, half)
        getattr(draw, kind)(xy, fill=colour)
    return np.asarray(image.reduce(spec.supersample), dtype=np.uint8)  # box filter: the mean of each block


def _make_split(spec: ShapesSpec, split: str) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    rng = np.random.default_rng([spec.seed, SPLITS.index(split)])
    n = spec.size(split)
    images = np.empty((n, spec.image_size, spec.image_size, 3), dtype=np.uint8)
    tokens = np.empty((n, spec.context_length), dtype=np.uint8)
    records = []
    for i in range(n):
        scene = sample_scene(rng, spec, split)
        text = caption(scene, rng)
        images[i] = render(scene, spec, rng)
        tokens[i] = tokenize(text, spec.context_length)
        records.append({"caption": text, "key": scene_key(scene),
                        "objects": [[o.colour, o.shape, o.size, o.position] for o in scene]})
    return images, tokens, records


# ------------------------------------------------------------------------------------------------- build
def shapes_root() -> Path:
    """Where shapes datasets live: ``data_root() / "shapes"``."""
    return data_root() / "shapes"


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _dataset_hash(files: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k} {files[k]}\n" for k in sorted(files)).encode()).hexdigest()


def build_shapes(name: str = "shapes", root: str | os.PathLike | None = None, **spec_kwargs: Any) -> Path:
    """Build (or rebuild, replacing it) the dataset ``<root>/<name>`` from ``ShapesSpec(**spec_kwargs)``."""
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"name: expected a plain folder name, got {name!r}")
    spec = ShapesSpec(**spec_kwargs)
    out = (Path(root).expanduser().resolve() if root is not None else shapes_root()) / name
    blobs: dict[str, bytes] = {}
    counts = {}
    for split in SPLITS:
        images, tokens, records = _make_split(spec, split)
        blobs[f"{split}_images.npy"] = _npy_bytes(images)
        blobs[f"{split}_tokens.npy"] = _npy_bytes(tokens)
        blobs[f"{split}_scenes.json"] = (json.dumps(records, indent=0) + "\n").encode()
        counts[split] = {"scenes": len(records), "distinct": len({r["key"] for r in records})}
    files = {k: hashlib.sha256(v).hexdigest() for k, v in blobs.items()}
    meta = {"params": spec.params(), "vocab": list(VOCAB), "splits": counts, "files": files,
            "dataset_hash": _dataset_hash(files)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for file, data in blobs.items():
            (tmp / file).write_bytes(data)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out


def ensure_shapes(name: str = "shapes", root: str | os.PathLike | None = None, **spec_kwargs: Any) -> Path:
    """The folder of dataset ``name``, built first if missing; one built from another spec is an error."""
    out = (Path(root).expanduser().resolve() if root is not None else shapes_root()) / name
    if not out.exists():
        return build_shapes(name, root, **spec_kwargs)
    wanted = ShapesSpec(**spec_kwargs).params()
    have = _read_meta(out).get("params", {})
    if have != wanted:
        differ = sorted(k for k in wanted if have.get(k) != wanted[k])
        raise ValueError(f"shapes dataset {str(out)!r} exists but was built with other settings "
                         f"({', '.join(differ)}); pass another name= or rebuild it with build_shapes(...)")
    return out


# -------------------------------------------------------------------------------------------------- load
@dataclass(frozen=True, eq=False)
class ShapesSplit:
    """One split: ``images`` uint8 (N, 3, H, W), ``tokens`` long (N, context_length), ``scene_ids`` long (N,)
    (equal ids: equal scenes), the ``captions`` and scene ``keys``."""

    name: str
    images: torch.Tensor
    tokens: torch.Tensor
    scene_ids: torch.Tensor
    captions: list[str]
    keys: list[str]

    def __len__(self) -> int:
        return len(self.captions)

    def pixels(self, index: Any = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Images scaled to [-1, 1] in ``dtype``."""
        return (self.images[index].to(torch.float32) / 127.5 - 1.0).to(dtype)


@dataclass(frozen=True, eq=False)
class ShapesData:
    path: Path
    splits: dict[str, ShapesSplit]
    meta: dict[str, Any] = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self.meta["vocab"])

    @property
    def context_length(self) -> int:
        return self.meta["params"]["context_length"]

    @property
    def image_size(self) -> int:
        return self.meta["params"]["image_size"]

    @property
    def dataset_hash(self) -> str:
        return self.meta["dataset_hash"]

    def split(self, name: str) -> ShapesSplit:
        if name not in self.splits:
            raise ValueError(f"split: expected one of {', '.join(SPLITS)}, got {name!r}")
        return self.splits[name]


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ShapesError(f"no shapes dataset at {str(path)!r}: build it with ensure_shapes() or "
                          f"data_scripts/build_shapes.py")
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        _ = meta["params"], meta["files"], meta["dataset_hash"], meta["vocab"]
    except FileNotFoundError:
        raise ShapesError(f"shapes folder {str(path)!r} is incomplete (no meta.json): delete it and rebuild") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ShapesError(f"{str(path / 'meta.json')!r} is not a shapes meta.json ({e!r}); rebuild") from None
    return meta


def load_shapes(path: str | os.PathLike) -> ShapesData:
    """Load a dataset folder, checking every file against its sha256 in ``meta.json`` (:class:`ShapesError`
    names the file that is missing or does not match)."""
    path = Path(path).expanduser().resolve()
    meta = _read_meta(path)
    if meta["vocab"] != list(VOCAB):
        raise ShapesError(f"{str(path)!r} was built with another vocabulary; rebuild it")
    data = {}
    for file, digest in meta["files"].items():
        try:
            blob = (path / file).read_bytes()
        except FileNotFoundError:
            raise ShapesError(f"shapes folder {str(path)!r} is incomplete (no {file}): rebuild it") from None
        if hashlib.sha256(blob).hexdigest() != digest:
            raise ShapesError(f"{str(path / file)!r} does not match meta.json: the file was changed or damaged; "
                              f"rebuild the dataset")
        data[file] = blob
    if _dataset_hash(meta["files"]) != meta["dataset_hash"]:
        raise ShapesError(f"dataset_hash in {str(path / 'meta.json')!r} does not match its files; rebuild")
    splits = {}
    for split in SPLITS:
        images = np.load(io.BytesIO(data[f"{split}_images.npy"]), allow_pickle=False)
        tokens = np.load(io.BytesIO(data[f"{split}_tokens.npy"]), allow_pickle=False)
        records = json.loads(data[f"{split}_scenes.json"])
        keys = [r["key"] for r in records]
        index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        splits[split] = ShapesSplit(
            name=split, images=torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
            tokens=torch.from_numpy(tokens.astype(np.int64)), scene_ids=torch.tensor([index[k] for k in keys]),
            captions=[r["caption"] for r in records], keys=keys)
    return ShapesData(path=path, splits=splits, meta=meta)


def shuffled_batches(n: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` index batches over ``n`` examples: epochs in a fresh order each (seeded), full batches only."""
    if batch_size > n:
        raise ValueError(f"batch_size={batch_size} exceeds the {n} examples")
    generator = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        order = torch.randperm(n, generator=generator)
        out += [order[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
    return out[:steps]
