"""Rendered shapes with captions: deterministic build, held-out combinations, captions that describe the image,
verified loading. Expected values come from the captions' words and the pixels, not from the generator's code."""

import json
import re

import numpy as np
import pytest
import torch

from macroarch.data import ShapesError, ShapesSpec, build_shapes, ensure_shapes, load_shapes, shuffled_batches
from macroarch.data.shapes import COLOURS, POSITIONS, SHAPES, VOCAB, ShapeObject, detokenize, render, tokenize

SMALL = dict(n_train=300, n_val=64, n_heldout=64)
PHRASE = re.compile(r"a (small|large) (\w+) (\w+) (?:at|in) the (top left|top right|bottom left|bottom right)")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return root, load_shapes(build_shapes("s", root, **SMALL))


def objects_of(caption: str) -> list[tuple[str, str, str, str]]:
    """(size, colour, shape, position) of every object a caption names, by the grammar's words alone."""
    found = PHRASE.findall(caption)
    assert found, caption
    return found


def test_build_is_deterministic_and_seeded(built, tmp_path):
    root, data = built
    again = load_shapes(build_shapes("again", tmp_path, **SMALL))
    other = load_shapes(build_shapes("other", tmp_path, **SMALL, seed=1))
    assert again.dataset_hash == data.dataset_hash
    assert torch.equal(again.split("train").images, data.split("train").images)
    assert other.dataset_hash != data.dataset_hash


def test_held_out_pairs_never_occur_in_training_and_every_held_out_scene_has_one(built):
    _, data = built
    held = {tuple(p) for p in data.meta["params"]["held_out"]}
    assert len(held) == 8 and {c for c, _ in held} == set(COLOURS)  # every colour keeps four shapes in training
    for split in ("train", "val"):
        pairs = {(c, s) for cap in data.split(split).captions for _, c, s, _ in objects_of(cap)}
        assert not pairs & held, split
        assert len(pairs) > 20  # the seen pairs do occur
    for cap in data.split("heldout").captions:
        assert any((c, s) in held for _, c, s, _ in objects_of(cap)), cap


def test_captions_tokens_and_scene_ids_agree(built):
    _, data = built
    train = data.split("train")
    assert data.vocab_size == len(VOCAB) and VOCAB[0] == "<pad>" and VOCAB[-1] == "<eot>"
    counts = set()
    for i in range(50):
        ids = train.tokens[i].tolist()
        assert ids == tokenize(train.captions[i], data.context_length)
        assert detokenize(ids) == train.captions[i]
        assert int(train.tokens[i].argmax()) == len(train.captions[i].split()) + 1  # open_clip pools at <eot>
        objs = objects_of(train.captions[i])
        counts.add(len(objs))
        positions = [p for *_, p in objs]
        assert positions == sorted(positions, key=POSITIONS.index) and len(set(positions)) == len(positions)
    assert counts == {1, 2, 3}
    keys = train.keys
    for i in range(len(keys)):
        for j in range(i + 1, min(len(keys), i + 40)):
            assert (keys[i] == keys[j]) == bool(train.scene_ids[i] == train.scene_ids[j])


def test_the_image_shows_what_the_caption_says(built):
    _, data = built
    split = data.split("val")
    size = data.image_size
    for i in range(len(split)):
        image = split.images[i].permute(1, 2, 0).numpy().astype(float)
        named = {p: (c, s) for s_, c, s, p in objects_of(split.captions[i])}
        for q, position in enumerate(POSITIONS):
            row, col = divmod(q, 2)
            cell = image[row * size // 2:(row + 1) * size // 2, col * size // 2:(col + 1) * size // 2].reshape(-1, 3)
            spread = cell.max(axis=1) - cell.min(axis=1)  # background is grey: 0 spread (white shapes too)
            lit = cell[(spread > 60) | (cell.min(axis=1) > 150)]
            if position not in named:
                assert len(lit) == 0, (split.captions[i], position)
                continue
            colour = np.array(COLOURS[named[position][0]], dtype=float)
            assert len(lit) >= 4, (split.captions[i], position)
            core = lit[lit.sum(axis=1) >= np.quantile(lit.sum(axis=1), 0.75)]  # the interior: edges blend in grey
            nearest = min(COLOURS, key=lambda c: np.abs(np.median(core, axis=0) - COLOURS[c]).sum())
            assert nearest == named[position][0], (split.captions[i], position, np.median(core, axis=0), colour)


def test_shapes_differ_in_area_as_geometry_says():
    spec = ShapesSpec(image_size=64, n_train=1, n_val=1, n_heldout=1)
    rng = np.random.default_rng(0)
    area = {}
    for shape in SHAPES:
        pixels = render((ShapeObject("white", shape, "large", "top left"),), spec, rng)
        area[shape] = float((pixels.astype(float).mean(axis=2) > 120).sum())
    # a circle covers pi/4 of its square; the square is 0.85^2 of it; triangle and diamond about half
    assert area["square"] < area["circle"] * 1.05 and area["triangle"] < area["circle"] * 0.8
    assert area["diamond"] < area["circle"] * 0.8 and area["cross"] < area["circle"]


def test_loading_checks_every_file(built, tmp_path):
    path = build_shapes("t", tmp_path, **SMALL)
    images = path / "heldout_images.npy"
    good = images.read_bytes()
    images.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit
    with pytest.raises(ShapesError, match="heldout_images.npy"):
        load_shapes(path)
    images.write_bytes(good)
    load_shapes(path)
    (path / "val_tokens.npy").unlink()
    with pytest.raises(ShapesError, match="val_tokens.npy"):
        load_shapes(path)
    with pytest.raises(ShapesError, match="no shapes dataset"):
        load_shapes(tmp_path / "missing")


def test_ensure_builds_once_and_refuses_other_settings(tmp_path):
    path = ensure_shapes("e", tmp_path, **SMALL)
    stamp = json.loads((path / "meta.json").read_text())["dataset_hash"]
    assert ensure_shapes("e", tmp_path, **SMALL) == path
    assert json.loads((path / "meta.json").read_text())["dataset_hash"] == stamp
    with pytest.raises(ValueError, match="n_train"):
        ensure_shapes("e", tmp_path, **{**SMALL, "n_train": 301})


@pytest.mark.parametrize("bad, match", [
    (dict(max_objects=5), "max_objects"),
    (dict(held_out=[("red", "hexagon")]), "held_out"),
    (dict(context_length=20), "context_length"),
    (dict(image_size=7), "image_size"),
    (dict(n_train=0), "n_train"),
])
def test_bad_specs_name_the_setting(bad, match):
    with pytest.raises(ValueError, match=match):
        ShapesSpec(**bad)


def test_tokenize_rejects_words_outside_the_grammar():
    with pytest.raises(ValueError, match="'hexagon'"):
        tokenize("a large red hexagon at the top left")


def test_shuffled_batches_are_epochs_of_permutations():
    batches = shuffled_batches(10, 3, 7, seed=0)
    assert len(batches) == 7 and all(len(b) == 3 for b in batches)
    for epoch in (batches[:3], batches[3:6]):  # 3 full batches per epoch of 10, the last example dropped
        seen = torch.cat(epoch)
        assert len(set(seen.tolist())) == 9
    assert all(torch.equal(a, b) for a, b in zip(batches, shuffled_batches(10, 3, 7, seed=0)))
    assert not all(torch.equal(a, b) for a, b in zip(batches, shuffled_batches(10, 3, 7, seed=1)))
    with pytest.raises(ValueError, match="batch_size"):
        shuffled_batches(2, 3, 1, seed=0)


def test_build_script(tmp_path, capsys):
    import importlib.util

    from macroarch.paths import project_root

    spec = importlib.util.spec_from_file_location("build_shapes", project_root() / "data_scripts" / "build_shapes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--root", str(tmp_path), "--n-train", "50", "--n-val", "8", "--n-heldout", "8"]) == 0
    out = capsys.readouterr().out
    assert "shapes_n50_s0" in out and "dataset_hash" in out
    assert script.main(["--root", str(tmp_path), "--max-objects", "9"]) == 2
    assert "max_objects" in capsys.readouterr().err
