"""A byte-level text corpus built from files on this machine, and its verified loader.

No download: by default the corpus is the ``.py`` source of the Python standard library that ships with the
interpreter (``sysconfig.get_paths()["stdlib"]``); ``sources=[DIR, ...]`` builds one from your own text files
through exactly the same code. Tokens are raw UTF-8 bytes (vocabulary 256), as in byte-level LMs (ByT5),
so no tokenizer has to be trained or fetched.

A build is deterministic, and a function of the files and the :class:`CorpusSpec` only:

- files are found under each source by name pattern, pruning excluded folders. For the standard library
  these are ``site-packages``, test suites (``test``, ``tests``, ``idle_test``), ``__pycache__``, the
  build's ``config-*`` folder and ``_sysconfigdata_*`` (machine-specific generated files);
- files that are empty or not UTF-8 are skipped, and counted in ``meta.json``;
- each file goes to train or val by a hash of its relative path (``val_fraction`` of the hash range), so
  adding a file never moves another. Both splits need a file: when the hash puts none in one, the file
  nearest the boundary moves over (the only case where a new file can move another);
- ``max_bytes`` caps train + val (separators included). Val gets ``val_fraction`` of it, train the rest.
  Within a split files are taken in hash order (a fixed pseudo-random sample, so a cap does not keep only
  the alphabetically first packages); the first file that does not fit is cut at a line boundary to fill
  the budget, and the taking stops;
- each split is its files in sorted relative-path order joined by ``separator`` (default ``0x1c``, ASCII
  "file separator", which UTF-8 text does not contain).

The output folder ``<root>/<name>/`` holds ``train.bin`` and ``val.bin`` (uint8) and ``meta.json`` (the
source, the spec, the files of each split, byte counts, the sha256 of each split and a ``corpus_hash``
over both). It is written to a temporary folder and renamed into place, so a folder with a ``meta.json``
is always complete. :func:`load_corpus` checks the hashes before handing out tensors.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import platform
import shutil
import sysconfig
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from macroarch.paths import project_root

log = logging.getLogger(__name__)

BYTE_VOCAB_SIZE = 256
FILE_SEPARATOR = b"\x1c"
DEFAULT_MAX_BYTES = 8_000_000
DEFAULT_PATTERNS = ("*.txt", "*.md", "*.py", "*.rst")
DEFAULT_EXCLUDE = (".*", "__pycache__", "site-packages", "dist-packages")
STDLIB_PATTERNS = ("*.py",)
STDLIB_EXCLUDE = DEFAULT_EXCLUDE + ("test", "tests", "idle_test", "config-*", "_sysconfigdata_*")
SPLITS = ("train", "val")
FORMAT_VERSION = 1


class CorpusError(RuntimeError):
    """A corpus folder that is missing, incomplete or does not match its ``meta.json``."""


@dataclass(frozen=True)
class CorpusSpec:
    """What a corpus is built from and how; recorded in ``meta.json`` as ``params``."""

    sources: tuple[str, ...] = ()
    """Folders of text files; empty means the standard library of the running interpreter."""
    patterns: tuple[str, ...] | None = None
    """File-name glob patterns; ``None``: ``*.py`` for the standard library, else ``DEFAULT_PATTERNS``."""
    exclude: tuple[str, ...] | None = None
    """Glob patterns for folder and file names to skip; ``None``: ``STDLIB_EXCLUDE`` or ``DEFAULT_EXCLUDE``."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Cap on train + val bytes, separators included."""
    val_fraction: float = 0.05
    """Share of the hash range (so about the share of files, and of ``max_bytes``) that goes to val."""
    separator: bytes = FILE_SEPARATOR
    """Bytes between two files of a split."""

    def __post_init__(self) -> None:
        if isinstance(self.sources, str | os.PathLike):
            raise ValueError(f"sources: expected a list of folders, got the single path {self.sources!r}")
        set_ = object.__setattr__  # frozen: fill the defaults once, here
        set_(self, "sources", tuple(str(Path(s).expanduser().resolve()) for s in self.sources))
        stdlib = not self.sources
        patterns = tuple(self.patterns) if self.patterns is not None else (
            STDLIB_PATTERNS if stdlib else DEFAULT_PATTERNS)
        exclude = tuple(self.exclude) if self.exclude is not None else (STDLIB_EXCLUDE if stdlib else DEFAULT_EXCLUDE)
        set_(self, "patterns", patterns)
        set_(self, "exclude", exclude)
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"patterns: expected non-empty glob patterns such as '*.txt', got {self.patterns!r}")
        names = [Path(s).name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"sources: two folders share a name ({names}); relative paths would collide")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 2:
            raise ValueError(f"max_bytes: expected an int >= 2 (one byte per split), got {self.max_bytes!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction: expected a number in (0, 1), got {self.val_fraction!r}")
        if not isinstance(self.separator, bytes):
            raise ValueError(f"separator: expected bytes, got {type(self.separator).__name__}")

    def source_dirs(self) -> list[Path]:
        return [Path(s) for s in self.sources] or [Path(sysconfig.get_paths()["stdlib"])]

    def params(self) -> dict[str, Any]:
        """The spec as JSON values (``meta.json["params"]``); two specs build the same corpus iff these match."""
        return {"sources": list(self.sources), "patterns": list(self.patterns), "exclude": list(self.exclude),
                "max_bytes": self.max_bytes, "val_fraction": self.val_fraction, "separator": self.separator.hex()}


@dataclass(frozen=True, eq=False)  # tensors have no truth value, so no field-wise __eq__
class TextCorpus:
    """A loaded corpus: byte tokens of each split (1-D ``torch.uint8``) and its ``meta.json``."""

    path: Path
    train: torch.Tensor
    val: torch.Tensor
    meta: dict[str, Any] = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def corpus_hash(self) -> str:
        return self.meta["corpus_hash"]

    def split(self, name: str) -> torch.Tensor:
        if name not in SPLITS:
            raise ValueError(f"split: expected one of {', '.join(SPLITS)}, got {name!r}")
        return getattr(self, name)


def data_root() -> Path:
    """Where built datasets live: ``$MACROARCH_DATA``, else ``<project root>/data``."""
    if env := os.environ.get("MACROARCH_DATA"):
        return Path(env).expanduser().resolve()
    return project_root() / "data"


def text_root() -> Path:
    """Where text corpora live: ``data_root() / "text"``."""
    return data_root() / "text"


def decode(tokens: torch.Tensor) -> str:
    """Byte tokens (an integer tensor of values in [0, 256)) back to text; broken UTF-8 becomes U+FFFD."""
    values = torch.as_tensor(tokens).reshape(-1).tolist()
    if any(not 0 <= v < BYTE_VOCAB_SIZE for v in values):
        raise ValueError("tokens: decode takes bytes (0-255); drop special ids and -100 labels first")
    return bytes(values).decode("utf-8", errors="replace")


def encode(text: str) -> torch.Tensor:
    """Text to its UTF-8 byte tokens as a 1-D ``torch.long`` tensor (the inverse of :func:`decode`)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


# ---------------------------------------------------------------------------------------------------- build


def _unit_hash(rel: str) -> float:
    """A uniform number in [0, 1) fixed by the relative path alone: decides the split and the sampling order."""
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big") / 2**64


def _excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)


def _collect(spec: CorpusSpec) -> tuple[dict[str, bytes], dict[str, list[str]]]:
    """Every matching UTF-8 file as ``{relative posix path: bytes}``, and what was skipped and why."""
    dirs = spec.source_dirs()
    files: dict[str, bytes] = {}
    skipped: dict[str, list[str]] = {"undecodable": [], "unreadable": [], "empty": []}
    for d in dirs:
        if not d.is_dir():
            raise ValueError(f"source folder {str(d)!r} does not exist or is not a folder")
        found, skipped_before = 0, sum(len(v) for v in skipped.values())
        for here, subdirs, names in os.walk(d):
            subdirs[:] = sorted(s for s in subdirs if not _excluded(s, spec.exclude))  # prune in place
            for file_name in names:
                if _excluded(file_name, spec.exclude) or not any(
                        fnmatch.fnmatchcase(file_name, p) for p in spec.patterns):
                    continue
                path = Path(here, file_name)
                rel = path.relative_to(d).as_posix()
                rel = rel if len(dirs) == 1 else f"{d.name}/{rel}"
                try:
                    data = path.read_bytes()
                    data.decode("utf-8")
                except UnicodeDecodeError:
                    skipped["undecodable"].append(rel)
                    continue
                except OSError:
                    skipped["unreadable"].append(rel)
                    continue
                if not data:
                    skipped["empty"].append(rel)
                    continue
                files[rel] = data
                found += 1
        if not found:
            n_bad = sum(len(v) for v in skipped.values()) - skipped_before
            raise ValueError(f"source folder {str(d)!r} holds no non-empty UTF-8 files matching "
                             f"{' '.join(spec.patterns)} ({n_bad} skipped as undecodable, unreadable or empty)")
    for reason, rels in skipped.items():
        if rels:
            log.info("skipped %d %s files, e.g. %s", len(rels), reason, rels[0])
    return files, {k: sorted(v) for k, v in skipped.items()}


def _assign_splits(rels: list[str], val_fraction: float) -> dict[str, list[str]]:
    """Split files by the hash of their path; each split gets at least one file. Lists are in hash order."""
    if len(rels) < 2:
        raise ValueError(f"a corpus needs at least 2 files (one per split), found {len(rels)}: {rels}")
    ranked = sorted(rels, key=_unit_hash)
    n_val = sum(_unit_hash(r) < val_fraction for r in ranked)
    n_val = min(max(n_val, 1), len(ranked) - 1)  # the files nearest the boundary move when a split is empty
    return {"val": ranked[:n_val], "train": ranked[n_val:]}


def _cut(data: bytes, budget: int) -> bytes:
    """At most ``budget`` bytes of ``data``: whole lines if one fits, else whole UTF-8 characters."""
    head = data[:budget]
    if (newline := head.rfind(b"\n")) >= 0:
        return head[: newline + 1]
    return head.decode("utf-8", errors="ignore").encode("utf-8")


def _take(ranked: list[str], files: dict[str, bytes], budget: int, sep: bytes) -> dict[str, bytes]:
    """Files in hash order while they fit in ``budget`` (separators counted); the first misfit is cut to fill it."""
    taken: dict[str, bytes] = {}
    used = 0
    for rel in ranked:
        cost = len(files[rel]) + (len(sep) if taken else 0)
        if used + cost <= budget:
            taken[rel] = files[rel]
            used += cost
            continue
        if part := _cut(files[rel], budget - used - (len(sep) if taken else 0)):
            taken[rel] = part
        break
    return taken


def _join(taken: dict[str, bytes], sep: bytes) -> bytes:
    return sep.join(taken[rel] for rel in sorted(taken))


def _source_description(spec: CorpusSpec) -> dict[str, Any]:
    python = f"{platform.python_implementation()} {platform.python_version()}"
    if spec.sources:
        return {"kind": "files", "folders": list(spec.sources), "python": python}
    return {"kind": "stdlib", "folders": [str(d) for d in spec.source_dirs()], "python": python,
            "description": f"the .py files of the {python} standard library"}


def _corpus_hash(split_hashes: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{s} {split_hashes[s]}\n" for s in SPLITS).encode()).hexdigest()


def _make(spec: CorpusSpec, name: str) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The bytes of each split and the ``meta.json`` that describes them."""
    files, skipped = _collect(spec)
    ranked = _assign_splits(sorted(files), spec.val_fraction)
    sep = spec.separator
    val_total = sum(len(files[r]) for r in ranked["val"]) + len(sep) * (len(ranked["val"]) - 1)
    val_budget = min(val_total, max(1, int(spec.max_bytes * spec.val_fraction)))
    taken = {"val": _take(ranked["val"], files, val_budget, sep)}
    blobs = {"val": _join(taken["val"], sep)}
    taken["train"] = _take(ranked["train"], files, spec.max_bytes - len(blobs["val"]), sep)
    blobs["train"] = _join(taken["train"], sep)
    for s in SPLITS:
        if not blobs[s]:
            raise ValueError(f"max_bytes={spec.max_bytes} leaves the {s} split empty; raise max_bytes")
    hashes = {s: hashlib.sha256(blobs[s]).hexdigest() for s in SPLITS}
    splits = {}
    for s in SPLITS:
        cut = [r for r, b in taken[s].items() if len(b) < len(files[r])]
        splits[s] = {"file": f"{s}.bin", "bytes": len(blobs[s]), "sha256": hashes[s], "n_files": len(taken[s]),
                     "n_files_available": len(ranked[s]), "truncated_file": cut[0] if cut else None,
                     "files": sorted(taken[s])}
    meta = {
        "name": name,
        "format_version": FORMAT_VERSION,
        "dtype": "uint8",
        "vocab_size": BYTE_VOCAB_SIZE,
        "source": _source_description(spec),
        "params": spec.params(),
        "n_files": sum(len(taken[s]) for s in SPLITS),
        "n_files_found": len(files),
        "skipped": {reason: {"count": len(rels), "examples": rels[:10]} for reason, rels in skipped.items()},
        "splits": splits,
        "corpus_hash": _corpus_hash(hashes),
    }
    return blobs, meta


def _write_atomically(out: Path, blobs: dict[str, bytes], meta: dict[str, Any]) -> None:
    """Write into a hidden sibling folder, then rename it into place: ``out`` is either absent or complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for s in SPLITS:
            (tmp / f"{s}.bin").write_bytes(blobs[s])
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if out.exists():
            out.rename(old)  # a directory cannot be renamed onto a non-empty one
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def build_corpus(name: str = "stdlib", root: str | os.PathLike | None = None, *, sources=(), patterns=None,
                 exclude=None, max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.05,
                 separator: bytes = FILE_SEPARATOR) -> Path:
    """Build (or rebuild, replacing it) the corpus ``<root>/<name>`` and return its folder.

    ``root`` defaults to :func:`text_root`. The keywords are the fields of :class:`CorpusSpec`; an empty
    ``sources`` means the standard library. Raises ValueError for bad settings and for a source folder with
    no matching UTF-8 text.
    """
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"name: expected a plain folder name, got {name!r}")
    spec = CorpusSpec(sources=sources, patterns=patterns, exclude=exclude, max_bytes=max_bytes,
                      val_fraction=val_fraction, separator=separator)
    out = Path(root).expanduser().resolve() / name if root is not None else text_root() / name
    blobs, meta = _make(spec, name)
    _write_atomically(out, blobs, meta)
    log.info("built corpus %s: %d files, %d train + %d val bytes, hash %s", out, meta["n_files"],
             meta["splits"]["train"]["bytes"], meta["splits"]["val"]["bytes"], meta["corpus_hash"][:12])
    return out


def ensure_corpus(name: str = "stdlib", root: str | os.PathLike | None = None, **build_kwargs) -> Path:
    """The folder of corpus ``name``, built first if it does not exist (so a fresh clone works).

    ``build_kwargs`` are :func:`build_corpus`'s keywords. An existing corpus built with other settings is
    an error, not silently replaced: pass another ``name`` or rebuild it with :func:`build_corpus`.
    """
    out = Path(root).expanduser().resolve() / name if root is not None else text_root() / name
    if not out.exists():
        return build_corpus(name, root, **build_kwargs)
    wanted = CorpusSpec(**build_kwargs).params()
    meta = _read_meta(out)
    if meta.get("params") != wanted:
        differ = sorted(k for k in wanted if meta.get("params", {}).get(k) != wanted[k])
        raise ValueError(f"corpus {str(out)!r} exists but was built with other settings ({', '.join(differ)}); "
                         f"pass another name= or rebuild it with build_corpus(...)")
    return out


# ----------------------------------------------------------------------------------------------------- load


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CorpusError(f"no corpus at {str(path)!r}: build it with ensure_corpus() or "
                          f"data_scripts/build_text_corpus.py")
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CorpusError(f"corpus folder {str(path)!r} is incomplete (no meta.json): delete it and rebuild")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        _ = meta["corpus_hash"], [meta["splits"][s]["sha256"] for s in SPLITS]
    except (ValueError, KeyError, TypeError) as e:
        raise CorpusError(f"{str(meta_file)!r} is not a corpus meta.json ({e!r}): delete the folder and rebuild"
                          ) from None
    return meta


def load_corpus(path: str | os.PathLike) -> TextCorpus:
    """Load a corpus folder, checking every split against the sha256 in ``meta.json``.

    Raises :class:`CorpusError` when the folder or a file is missing or a hash or size does not match.
    """
    path = Path(path).expanduser().resolve()
    meta = _read_meta(path)
    tokens = {}
    for s in SPLITS:
        info = meta["splits"][s]
        file = path / info["file"]
        if not file.is_file():
            raise CorpusError(f"corpus folder {str(path)!r} is incomplete (no {info['file']}): delete it and rebuild")
        data = np.fromfile(file, dtype=np.uint8)
        digest = hashlib.sha256(data).hexdigest()
        if data.size != info["bytes"] or digest != info["sha256"]:
            raise CorpusError(f"{str(file)!r} does not match meta.json ({data.size} bytes, sha256 {digest[:12]}..., "
                              f"expected {info['bytes']} bytes, {info['sha256'][:12]}...): the file was changed or "
                              f"damaged; rebuild the corpus")
        tokens[s] = torch.from_numpy(data)
    if _corpus_hash({s: meta["splits"][s]["sha256"] for s in SPLITS}) != meta["corpus_hash"]:
        raise CorpusError(f"corpus_hash in {str(path / 'meta.json')!r} does not match its split hashes; rebuild")
    return TextCorpus(path=path, train=tokens["train"], val=tokens["val"], meta=meta)
