"""Text corpus: deterministic build, stable splits, verified loading; LM and BERT masked-LM batches.

Expected bytes and rates are rebuilt here from the source files and from the definitions (separator join,
BERT's 80/10/10 rule), not read back from the code under test.
"""

import hashlib
import json
import re
import sysconfig
from pathlib import Path

import pytest
import torch

from macroarch.data import (
    CLS_ID,
    FILE_SEPARATOR,
    IGNORE_INDEX,
    MASK_ID,
    MLM_VOCAB_SIZE,
    PAD_ID,
    SEP_ID,
    CorpusError,
    build_corpus,
    decode,
    encode,
    ensure_corpus,
    eval_batches,
    lm_batches,
    load_corpus,
    mlm_batches,
)


def write_texts(folder: Path, count: int, start: int = 0) -> dict[str, bytes]:
    """``count`` small UTF-8 files (some in a subfolder, some non-ASCII); returns {relative path: bytes}."""
    files = {}
    for i in range(start, start + count):
        rel = f"sub/doc{i:03d}.md" if i % 3 == 0 else f"doc{i:03d}.txt"
        data = "".join(f"line {j} of file {i}: café ünïcode\n" for j in range(i % 7 + 1)).encode("utf-8")
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
        files[rel] = data
    return files


def read_meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text(encoding="utf-8"))


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    return folder, write_texts(folder, 40)


# ------------------------------------------------------------------------------------------------- build


def test_user_files_become_the_sorted_separator_join_of_each_split(texts, tmp_path):
    folder, files = texts
    (folder / "notes.bin").write_bytes(b"not a pattern match")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD.txt").write_text("hidden folders are skipped")
    path = build_corpus("mine", tmp_path / "corpora", sources=[folder], val_fraction=0.25)
    meta = read_meta(path)

    assert path == (tmp_path / "corpora" / "mine").resolve()
    assert meta["source"]["kind"] == "files" and meta["source"]["folders"] == [str(folder.resolve())]
    listed = meta["splits"]["train"]["files"] + meta["splits"]["val"]["files"]
    assert sorted(listed) == sorted(files)  # every file, once; no .bin, nothing under .git
    assert meta["splits"]["val"]["files"] and meta["splits"]["train"]["files"]
    for split in ("train", "val"):
        expected = FILE_SEPARATOR.join(files[rel] for rel in sorted(meta["splits"][split]["files"]))
        assert (path / f"{split}.bin").read_bytes() == expected
        assert meta["splits"][split]["sha256"] == hashlib.sha256(expected).hexdigest()


def test_two_builds_are_identical(texts, tmp_path):
    folder, _ = texts
    a = build_corpus("c", tmp_path / "a", sources=[folder], max_bytes=2000)
    b = build_corpus("c", tmp_path / "b", sources=[folder], max_bytes=2000)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert read_meta(a)["corpus_hash"] == read_meta(b)["corpus_hash"]


def test_max_bytes_caps_both_splits_together(texts, tmp_path):
    folder, files = texts
    path = build_corpus("c", tmp_path, sources=[folder], max_bytes=1500, val_fraction=0.2)
    sizes = {s: len((path / f"{s}.bin").read_bytes()) for s in ("train", "val")}
    assert sum(sizes.values()) <= 1500 < sum(len(d) for d in files.values())
    assert sum(sizes.values()) > 1500 - 100  # filled up to (about) a line of the budget
    assert 0 < sizes["val"] <= 0.2 * 1500


def test_stdlib_is_the_default_source(tmp_path):
    path = build_corpus(root=tmp_path, max_bytes=60_000)
    meta = read_meta(path)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert path.name == "stdlib" and meta["source"]["kind"] == "stdlib"
    assert meta["source"]["python"].endswith(".".join(map(str, __import__("sys").version_info[:3])))
    files = meta["splits"]["train"]["files"] + meta["splits"]["val"]["files"]
    assert files and all(rel.endswith(".py") and (stdlib / rel).is_file() for rel in files)
    assert not any(part in {"test", "tests", "site-packages"} for rel in files for part in rel.split("/"))
    total = sum(meta["splits"][s]["bytes"] for s in ("train", "val"))
    assert total <= 60_000 and total == path.joinpath("train.bin").stat().st_size + path.joinpath("val.bin").stat(
    ).st_size


def test_undecodable_and_empty_files_are_skipped_and_counted(texts, tmp_path):
    folder, files = texts
    (folder / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (folder / "empty.txt").write_bytes(b"")
    meta = read_meta(build_corpus("c", tmp_path, sources=[folder]))
    assert meta["skipped"]["undecodable"] == {"count": 1, "examples": ["latin1.txt"]}
    assert meta["skipped"]["empty"]["count"] == 1
    assert meta["n_files"] == len(files)


def test_a_folder_without_text_is_a_value_error_naming_it(tmp_path):
    folder = tmp_path / "pictures"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"\x89PNG")
    (folder / "b.txt").write_bytes(b"\xff\xfe\xfa")  # matches the pattern, but is not UTF-8
    with pytest.raises(ValueError, match=re.escape(str(folder.resolve()))):
        build_corpus("c", tmp_path / "out", sources=[folder])
    with pytest.raises(ValueError, match="does not exist"):
        build_corpus("c", tmp_path / "out", sources=[tmp_path / "missing"])
    assert not (tmp_path / "out" / "c").exists()


def test_adding_a_file_keeps_every_other_file_in_its_split(texts, tmp_path):
    folder, _ = texts
    before = read_meta(build_corpus("c", tmp_path, sources=[folder], val_fraction=0.25))["splits"]
    write_texts(folder, 5, start=100)
    after = read_meta(build_corpus("c", tmp_path, sources=[folder], val_fraction=0.25))["splits"]
    for split in ("train", "val"):
        assert set(before[split]["files"]) <= set(after[split]["files"])
    assert len(after["train"]["files"]) + len(after["val"]["files"]) == 45


def test_a_failed_build_leaves_the_old_corpus_and_no_debris(texts, tmp_path, monkeypatch):
    folder, _ = texts
    path = build_corpus("c", tmp_path, sources=[folder])
    old = read_meta(path)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", fail)  # meta.json, written last, fails
    with pytest.raises(OSError, match="disk full"):
        build_corpus("c", tmp_path, sources=[folder], max_bytes=500)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir() if p.name != "texts"] == ["c"]
    assert read_meta(path) == old and load_corpus(path).meta == old


def test_ensure_corpus_builds_once_under_macroarch_data(texts, tmp_path, monkeypatch):
    folder, _ = texts
    monkeypatch.setenv("MACROARCH_DATA", str(tmp_path / "data"))
    path = ensure_corpus("mine", sources=[folder], max_bytes=1000)
    assert path == (tmp_path / "data" / "text" / "mine").resolve()
    stamp = (path / "meta.json").stat().st_mtime_ns
    assert ensure_corpus("mine", sources=[folder], max_bytes=1000) == path
    assert (path / "meta.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(ValueError, match="max_bytes"):
        ensure_corpus("mine", sources=[folder], max_bytes=2000)


# -------------------------------------------------------------------------------------------------- load


def test_load_corpus_returns_the_bytes_and_verifies_them(texts, tmp_path):
    folder, _ = texts
    path = build_corpus("c", tmp_path, sources=[folder])
    corpus = load_corpus(path)
    assert corpus.vocab_size == 256 and corpus.train.dtype == torch.uint8 and corpus.train.ndim == 1
    assert bytes(corpus.val.tolist()) == (path / "val.bin").read_bytes()
    assert corpus.corpus_hash == read_meta(path)["corpus_hash"]

    data = bytearray((path / "train.bin").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / "train.bin").write_bytes(bytes(data))
    with pytest.raises(CorpusError, match="train.bin"):
        load_corpus(path)


def test_load_corpus_refuses_incomplete_or_missing_folders(texts, tmp_path):
    folder, _ = texts
    path = build_corpus("c", tmp_path, sources=[folder])
    (path / "val.bin").unlink()
    with pytest.raises(CorpusError, match="val.bin"):
        load_corpus(path)
    (path / "meta.json").unlink()
    with pytest.raises(CorpusError, match="meta.json"):
        load_corpus(path)
    with pytest.raises(CorpusError, match="no corpus"):
        load_corpus(tmp_path / "nothing")


def test_encode_decode_round_trip():
    text = "def f(x):  # ünïcode ✓\n"
    assert decode(encode(text)) == text and encode(text).dtype == torch.long
    with pytest.raises(ValueError, match="tokens"):
        decode(torch.tensor([65, MASK_ID]))


# ----------------------------------------------------------------------------------------------- batches


def counting_tokens(n: int, period: int = 251) -> torch.Tensor:
    """Byte stream ``i % period``: any window is identified by its first byte, so we can check it."""
    return (torch.arange(n) % period).to(torch.uint8)


def test_lm_batches_are_windows_of_the_stream_reproducible_by_seed():
    tokens = counting_tokens(5000)
    batches = list(lm_batches(tokens, 8, 64, seed=1, steps=3))
    assert len(batches) == 3
    for input_ids, labels in batches:
        assert input_ids.shape == labels.shape == (8, 64) and input_ids.dtype == labels.dtype == torch.int64
        assert torch.equal(input_ids, labels) and input_ids.data_ptr() != labels.data_ptr()
        assert torch.all((input_ids[:, 1:] - input_ids[:, :-1]) % 251 == 1)  # contiguous slices
    again = list(lm_batches(tokens, 8, 64, seed=1, steps=3))
    other = next(lm_batches(tokens, 8, 64, seed=2))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    assert not torch.equal(batches[0][0], other[0])


def test_eval_batches_are_fixed_non_overlapping_windows():
    tokens = torch.arange(1000)  # token value = position
    batches = list(eval_batches(tokens, 4, 10, max_batches=3))
    assert [b[0].shape for b in batches] == [(4, 10)] * 3
    starts = torch.cat([b[0][:, 0] for b in batches]).tolist()
    assert starts == sorted(starts) and all(b - a >= 10 for a, b in zip(starts, starts[1:]))
    assert starts[-1] >= 800  # spread over the split, not its first 120 bytes
    everything = list(eval_batches(tokens, 32, 10))
    assert sum(len(b[0]) for b in everything) == 100 and len(everything[-1][0]) == 100 - 3 * 32


@pytest.mark.parametrize(("call", "name"), [
    (lambda t: lm_batches(t, 2, 101, seed=0), "seq_len"),
    (lambda t: lm_batches(t, 0, 10, seed=0), "batch_size"),
    (lambda t: lm_batches(t, 2, 10, seed=0, steps=-1), "steps"),
    (lambda t: eval_batches(t, 2, 10, max_batches=0), "max_batches"),
    (lambda t: mlm_batches(t, 2, 103, seed=0), "seq_len"),
    (lambda t: mlm_batches(t, 2, 10, seed=0, mask_prob=0.0), "mask_prob"),
    (lambda t: mlm_batches(t, 2, 10, seed=0, mask_token_prob=0.95), "random_token_prob"),
])
def test_bad_batch_arguments_name_themselves_at_call_time(call, name):
    with pytest.raises(ValueError, match=name):
        call(counting_tokens(100))  # raised by the call itself, before any next()


def test_mlm_batches_follow_berts_masking_rule():
    B, T, p = 256, 130, 0.15
    batch = next(mlm_batches(counting_tokens(20_000), B, T, seed=0, mask_prob=p))
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == mask.shape == labels.shape == (B, T) and ids.dtype == labels.dtype == torch.int64
    assert torch.all(ids[:, 0] == CLS_ID) and torch.all(ids[:, -1] == SEP_ID) and torch.all(mask == 1)
    assert torch.all(labels[:, [0, -1]] == IGNORE_INDEX)

    body_ids, body_labels = ids[:, 1:-1], labels[:, 1:-1]
    selected = body_labels != IGNORE_INDEX
    # The original bytes: the label where selected, the input elsewhere. They must be a window of the stream,
    # which holds only if labels are the true bytes and unselected inputs are untouched.
    original = torch.where(selected, body_labels, body_ids)
    assert torch.all((original[:, 1:] - original[:, :-1]) % 251 == 1)

    n = selected.sum().item()
    sd = (p * (1 - p) / selected.numel()) ** 0.5
    assert abs(n / selected.numel() - p) < 5 * sd
    chosen_ids, chosen_orig = body_ids[selected], original[selected]
    masked = (chosen_ids == MASK_ID).float().mean().item()
    kept = (chosen_ids == chosen_orig).float().mean().item()
    replaced = ((chosen_ids != MASK_ID) & (chosen_ids != chosen_orig)).float().mean().item()
    # a random byte equals the original one time in 256
    for rate, expected in ((masked, 0.8), (kept, 0.1 + 0.1 / 256), (replaced, 0.1 * 255 / 256)):
        assert abs(rate - expected) < 5 * (expected * (1 - expected) / n) ** 0.5
    assert torch.all(chosen_ids[chosen_ids != MASK_ID] < 256)  # random replacements are bytes, never specials


def test_mlm_batches_are_reproducible_and_every_row_has_a_target():
    tokens = counting_tokens(1000)
    a = list(mlm_batches(tokens, 64, 4, seed=3, steps=2))
    b = list(mlm_batches(tokens, 64, 4, seed=3, steps=2))
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    assert all(torch.all((batch["labels"] != IGNORE_INDEX).any(dim=1)) for batch in a)


def test_mlm_batches_train_a_tiny_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=MLM_VOCAB_SIZE, pad_token_id=PAD_ID, hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64)
    model = transformers.BertForMaskedLM(config)
    batch = next(mlm_batches(counting_tokens(2000), 4, 64, seed=0))
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
