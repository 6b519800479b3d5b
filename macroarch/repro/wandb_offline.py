"""Read W&B offline runs back from disk, without a server and without ``wandb sync``.

Why this exists
---------------
``wandb.init(mode="offline", dir=D)`` (wandb 0.31) writes everything a run logged into one
binary *transaction log*, ``D/wandb/offline-run-<YYYYmmdd_HHMMSS>-<id>/run-<id>.wandb``, and
writes **no** ``wandb-summary.json`` / ``wandb-history.jsonl``. So the only way to look at an
offline run's numbers (e.g. from a notebook, or in a test asserting what a training loop logged) is
to decode that log. This module does that and hands back a plain :class:`OfflineRun`.

File format (what wandb-core 0.31 writes)
-----------------------------------------
* A 7-byte file header: ``b":W&B"`` + uint16 LE magic ``0xBEE1`` + uint8 version ``0``.
* Then the LevelDB *log* format (https://github.com/google/leveldb/blob/main/doc/log_format.md):
  32 KiB blocks of chunks, each chunk = ``crc32 (uint32 LE) | length (uint16 LE) | type (uint8) |
  payload``, type FULL/FIRST/MIDDLE/LAST. The file header sits *inside* the first block (it counts
  towards block 0's 32 KiB). wandb uses the plain IEEE CRC-32 (``zlib.crc32``) over
  ``type byte + payload``, not LevelDB's masked CRC-32C.
* Each reassembled record is a serialized ``wandb.proto.wandb_internal_pb2.Record``.

wandb 0.31 does **not** ship a Python reader for this format any more: the old
``wandb/sdk/internal/datastore.py`` (``DataStore.scan_data``) was removed together with the Python
internal process, and the only reader now lives in the Go ``wandb-core`` binary
(``core/pkg/leveldb``), which has no Python binding. So the ~60-line chunk reader below is
unavoidable; everything *inside* a record is decoded with wandb's own protobuf ``Record`` class.

Why not ``wandb leet inspect --json``
-------------------------------------
wandb 0.31 ships ``wandb leet inspect --json`` (every record as JSON) and ``--summary --json`` (state,
summary, config, console tail). It is the right tool to *look* at a run (the README shows it), but the
paper cannot be built on it, for three reasons measured on 0.31.0:

* it re-encodes values through Go's JSON, so a float with an integral value loses its type
  (``run.summary.update({"x": 1.4e12})`` comes back as ``1400000000000``): the W&B-sourced paper would
  print ``1400000000000`` where the result-sourced one prints ``1.4e+12``, and the test that holds both
  papers equal would fail for a formatting reason. Here ``value_json`` is decoded as the SDK wrote it;
* ``--summary`` reads one run (the latest by default) and has no history or artifact records; the
  record stream has them, but costs a Go process start per run (about 1 s on 2 cores), where this
  reader decodes a run in milliseconds;
* it is a terminal tool without a Python API, so errors come back as exit codes and text.

Semantics (mirroring what the W&B app would show after ``wandb sync``)
----------------------------------------------------------------------
* **config**: the run record's config, then every config record's ``update``/``remove`` in order.
  Values are ``json.loads(value_json)``, so nested dicts come back nested. wandb's internal
  ``"_wandb"`` key (telemetry, runtime, ...) is dropped.
* **history**: one dict per history record. Keys are rebuilt from ``nested_key`` (a logged
  ``{"val": {"loss": x}}`` becomes ``nested_key=["val", "loss"]`` and comes back as
  ``{"val": {"loss": x}}``); a key containing ``"/"`` or ``"."`` is *not* split (wandb doesn't).
  Includes wandb's ``_step``, ``_runtime`` and ``_timestamp``. Floats come back bit-exact, but
  with the default ``x_history_value_encoding="json"`` wandb-core re-encodes history JSON and a
  logged ``2.0`` comes back as ``2`` (equal, but an ``int``); with ``"json,typed"`` the typed value
  is used and stays a ``float``. (Config and explicit summary values keep the SDK's own JSON.)
* **summary**: records are replayed in file order. A history row sets the summary of each key it
  logs to the row's value (wandb's "last logged value"), and explicit ``run.summary`` updates /
  deletions apply on top, so whichever happened *last* wins -- exactly as in a live run.
  wandb-core 0.31 already writes a derived summary record before every history record; keys with a
  ``define_metric(summary=...)`` are left to those records (so ``{"min": ...}`` survives).
  Top-level ``"_wandb"`` (internal runtime bookkeeping) is dropped here too.
* **exit_code**: from the exit record; ``None`` when there is none (the process died without
  ``finish()`` -- ``os._exit``, SIGKILL, OOM, power loss).

Reading right after ``run.finish()``: ``finish()`` returns once wandb-core has *accepted* the exit
record, not once the log is on disk, so under load the last records (incl. the exit record) can land
a few milliseconds later. Call ``wandb.teardown()`` first (it waits for wandb-core to exit, which
closes and flushes every run log; ~3 ms), or poll until ``exit_code is not None``.

Crashed / still-running runs: wandb-core buffers the log and flushes it every
``x_transaction_log_flush_interval`` seconds (default 15) and at ``finish()``. A hard crash therefore
loses the unflushed tail -- possibly everything except the 7-byte header -- and can leave a
half-written chunk at the end. A log that simply *ends early* is read up to the last complete record
(that is the normal shape of a crashed run). A log that is damaged in the middle (bad header, CRC
mismatch, broken chunk sequence, undecodable protobuf) raises ``ValueError``.

``wandb`` is an optional dependency of macroarch (``macroarch[tracking]``), so it is imported
lazily, only when a run is actually read.
"""

from __future__ import annotations

import fnmatch
import json
import re
import struct
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from os import PathLike
from pathlib import Path
from typing import Any

__all__ = ["OfflineArtifact", "OfflineRun", "OfflineRunWarning", "find_offline_runs", "read_offline_run"]

# --- the on-disk format (wandb-core/pkg/leveldb + wandb's stream writer) ---------------------
_FILE_IDENT = b":W&B"
_FILE_MAGIC = 0xBEE1
_FILE_VERSION = 0
_FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version: 7 bytes
_BLOCK_SIZE = 32 * 1024
_CHUNK_HEADER = struct.Struct("<IHB")  # crc32, payload length, chunk type: 7 bytes
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4

_RUN_DIR_RE = re.compile(r"^offline-run-(?P<ts>\d{8}_\d{6})-(?P<id>[^-]+)")
_WANDB_INTERNAL_KEY = "_wandb"


class OfflineRunWarning(UserWarning):
    """Emitted by :func:`find_offline_runs` for an offline-run directory it had to skip."""


@dataclass(frozen=True)
class OfflineArtifact:
    """An artifact an offline run logged: its files are where ``files`` says (name in the artifact -> path)."""

    name: str
    type: str
    metadata: dict
    files: dict  # path in the artifact -> local path (as staged when the run logged it)


@dataclass(frozen=True)
class OfflineRun:
    """One offline W&B run, decoded from its ``run-<id>.wandb`` transaction log."""

    run_id: str
    project: str | None
    name: str | None
    group: str | None
    tags: tuple[str, ...]
    directory: Path  # the offline-run-* folder
    started: datetime | None  # timezone-aware (UTC)
    config: dict  # as the user passed it, nested; "_wandb" stripped
    summary: dict  # final summary (last logged value per key, explicit updates applied in order)
    history: list[
        dict
    ]  # one dict per logged step, incl. "_step", "_runtime", "_timestamp"
    exit_code: (
        int | None
    )  # None: no exit record, i.e. the run never called finish() (crashed)
    files: Path  # the run's files/ folder (may not exist for a crashed run)
    artifacts: tuple[OfflineArtifact, ...] = ()  # in the order they were logged
    job_type: str | None = None


# --- low level: the record log ----------------------------------------------------------------


def _iter_record_payloads(path: Path) -> Iterator[bytes]:
    """Yield the raw payload of every complete record in a ``.wandb`` log, in order.

    Reads the whole file (these logs are small next to the runs that produce them) and walks it
    block by block, the way ``wandb-core``'s Go reader does. Stops quietly at a torn tail (a chunk
    or multi-chunk record cut off by end-of-file); raises ``ValueError`` for anything else wrong.
    """
    data = path.read_bytes()
    if len(data) < _FILE_HEADER.size:
        raise ValueError(
            f"{path}: not a wandb run log (only {len(data)} bytes, no file header)"
        )
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if ident != _FILE_IDENT or magic != _FILE_MAGIC:
        raise ValueError(f"{path}: not a wandb run log (bad file header {data[:7]!r})")
    if version != _FILE_VERSION:
        raise ValueError(f"{path}: unsupported wandb run log version {version}")

    pos = _FILE_HEADER.size  # the file header lives inside block 0
    end = len(data)
    pending: list[bytes] | None = (
        None  # chunks of a FIRST..LAST record being reassembled
    )
    while pos < end:
        left_in_block = _BLOCK_SIZE - pos % _BLOCK_SIZE
        if left_in_block < _CHUNK_HEADER.size:
            # The writer zero-fills a block tail too short for a chunk header.
            pos += left_in_block
            continue
        if pos + _CHUNK_HEADER.size > end:
            return  # torn tail: a chunk header cut short by a crash
        crc, length, ctype = _CHUNK_HEADER.unpack_from(data, pos)
        if crc == 0 and length == 0 and ctype == 0:
            # Zero padding (pre-allocated / zeroed block rest): skip to the next block.
            pos += left_in_block
            continue
        start, stop = pos + _CHUNK_HEADER.size, pos + _CHUNK_HEADER.size + length
        if length > left_in_block - _CHUNK_HEADER.size:
            raise ValueError(
                f"{path}: corrupt chunk at byte {pos} (length crosses a block boundary)"
            )
        if stop > end:
            return  # torn tail: a chunk payload cut short by a crash
        payload = data[start:stop]
        if zlib.crc32(payload, zlib.crc32(bytes((ctype,)))) != crc:
            raise ValueError(f"{path}: corrupt chunk at byte {pos} (checksum mismatch)")
        pos = stop

        if ctype == _FULL and pending is None:
            yield payload
        elif ctype == _FIRST and pending is None:
            pending = [payload]
        elif ctype == _MIDDLE and pending is not None:
            pending.append(payload)
        elif ctype == _LAST and pending is not None:
            pending.append(payload)
            yield b"".join(pending)
            pending = None
        else:
            raise ValueError(
                f"{path}: corrupt chunk sequence at byte {pos} (chunk type {ctype})"
            )
    # A FIRST/MIDDLE without its LAST at end-of-file is a torn tail too: dropped.


def _iter_records(path: Path) -> Iterator[Any]:
    """Yield each record of a ``.wandb`` log as wandb's own protobuf ``Record``."""
    from google.protobuf.message import DecodeError
    from wandb.proto.wandb_internal_pb2 import Record

    for payload in _iter_record_payloads(path):
        record = Record()
        try:
            record.ParseFromString(payload)
        except DecodeError as exc:
            raise ValueError(f"{path}: undecodable record ({exc})") from exc
        yield record


# --- values and nested keys --------------------------------------------------------------------


def _item_path(item: Any) -> list[str]:
    """The key path of a Summary/Config/HistoryItem.

    wandb uses two encodings: ``key="verdict"`` (one top-level key, whatever characters it holds --
    ``"a/b"`` is *one* key) or ``nested_key=["verdict", "grade"]`` (a path into nested dicts). The
    Python SDK sends explicit ``run.summary[...]``/``config`` updates with ``key`` (nested dicts
    inside ``value_json``) and nested summary assignment (``run.summary["v"]["g"] = 1``) with
    ``nested_key``; wandb-core rewrites every history item and derived summary into
    ``nested_key``, flattening logged dicts to one item per leaf.
    """
    return list(item.nested_key) if len(item.nested_key) else [item.key]


def _json_value(item: Any, where: Path) -> Any:
    text = item.value_json
    if not text:
        return None
    try:
        # json.loads gives the exact float back for any repr()/Go-formatted double and accepts
        # the NaN / Infinity / -Infinity tokens wandb writes.
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"{where}: bad value_json for {_item_path(item)!r}: {text[:80]!r}"
        ) from exc


def _history_value(item: Any, where: Path) -> Any:
    # With Settings(x_history_value_encoding="json,typed") the SDK also writes a typed value,
    # which (unlike value_json, re-encoded by wandb-core) keeps a logged 2.0 a float.
    kind = item.WhichOneof("value")
    if kind is None:
        return _json_value(item, where)
    if kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    return getattr(item, kind)  # boolean / integer / number / text


def _set_path(target: dict, path: list[str], value: Any) -> None:
    node = target
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def _remove_path(target: dict, path: list[str]) -> None:
    node: Any = target
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)


def _metric_has_custom_summary(metric: Any) -> bool:
    return metric.HasField("summary") and any(
        value for _, value in metric.summary.ListFields()
    )


# --- public API -------------------------------------------------------------------------------


def _resolve_log_file(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no such wandb offline run (path does not exist)"
        )
    if path.is_file():
        if path.suffix != ".wandb":
            raise ValueError(
                f"{path}: not a wandb run log (expected a run-<id>.wandb file)"
            )
        return path
    candidates = sorted(path.glob("run-*.wandb"))
    if not candidates:
        raise FileNotFoundError(
            f"{path}: not a wandb offline run directory (no run-<id>.wandb file in it)"
        )
    if len(candidates) > 1:
        raise ValueError(
            f"{path}: several run logs, pass one explicitly: {[c.name for c in candidates]}"
        )
    return candidates[0]


def _started_from_dirname(directory: Path) -> datetime | None:
    # wandb names the folder after the *local* start time, to the second.
    match = _RUN_DIR_RE.match(directory.name)
    if not match:
        return None
    try:
        local = datetime.strptime(match["ts"], "%Y%m%d_%H%M%S")
    except ValueError:
        return None
    return local.astimezone(UTC)


def read_offline_run(path: str | PathLike[str]) -> OfflineRun:
    """Read one offline run: ``path`` is its ``offline-run-*`` folder or its ``run-<id>.wandb``.

    Raises ``FileNotFoundError`` (missing path, or a folder without a run log) or ``ValueError``
    (not a wandb log / corrupt log), each naming the path.
    """
    log_file = _resolve_log_file(Path(path))
    directory = log_file.parent

    run_id: str | None = None
    project = name = group = job_type = None
    tags: tuple[str, ...] = ()
    started: datetime | None = None
    config: dict = {}
    summary: dict = {}
    history: list[dict] = []
    exit_code: int | None = None
    artifacts: list[OfflineArtifact] = []
    # define_metric(name/glob, summary=...) entries: their summary comes from wandb-core's derived
    # summary records ({"min": ..}, {"max": ..}), not from "last value logged".
    custom_summary_names: set[str] = set()
    custom_summary_globs: list[str] = []

    def custom_summary(key_path: list[str]) -> bool:
        flat = ".".join(key_path)
        return flat in custom_summary_names or any(
            fnmatch.fnmatchcase(flat, g) for g in custom_summary_globs
        )

    for record in _iter_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            # The first run record carries the identity and the init config; later ones (e.g.
            # a rename) only set what they carry.
            run = record.run
            run_id = run.run_id or run_id
            project = run.project or project
            name = run.display_name or name
            group = run.run_group or group
            job_type = run.job_type or job_type
            if run.tags:
                tags = tuple(run.tags)
            if (
                started is None
                and run.HasField("start_time")
                and (run.start_time.seconds or run.start_time.nanos)
            ):
                started = run.start_time.ToDatetime(tzinfo=UTC)
            for item in run.config.update:
                _set_path(config, _item_path(item), _json_value(item, log_file))
            for item in run.config.remove:
                _remove_path(config, _item_path(item))
        elif kind == "config":
            for item in record.config.update:
                _set_path(config, _item_path(item), _json_value(item, log_file))
            for item in record.config.remove:
                _remove_path(config, _item_path(item))
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                key_path = _item_path(item)
                value = _history_value(item, log_file)
                _set_path(row, key_path, value)
                if not custom_summary(key_path):
                    _set_path(summary, key_path, value)
            if "_step" not in row and record.history.HasField("step"):
                row["_step"] = record.history.step.num
            history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _set_path(summary, _item_path(item), _json_value(item, log_file))
            for item in record.summary.remove:
                _remove_path(summary, _item_path(item))
        elif kind == "metric":
            metric = record.metric
            if _metric_has_custom_summary(metric):
                if metric.name:
                    custom_summary_names.add(metric.name)
                if metric.glob_name:
                    custom_summary_globs.append(metric.glob_name)
        elif kind == "exit":
            exit_code = int(record.exit.exit_code)
        elif kind == "artifact":
            art = record.artifact
            try:
                metadata = json.loads(art.metadata) if art.metadata else {}
            except ValueError:
                metadata = {}
            artifacts.append(OfflineArtifact(name=art.name, type=art.type, metadata=metadata,
                                             files={e.path: Path(e.local_path) for e in art.manifest.contents}))

    config.pop(_WANDB_INTERNAL_KEY, None)
    summary.pop(_WANDB_INTERNAL_KEY, None)
    if run_id is None:
        # Crashed before the run record reached disk: fall back to the file name, run-<id>.wandb.
        run_id = log_file.stem.removeprefix("run-")
    return OfflineRun(
        run_id=run_id,
        project=project,
        name=name,
        group=group,
        tags=tags,
        directory=directory,
        started=started if started is not None else _started_from_dirname(directory),
        config=config,
        summary=summary,
        history=history,
        exit_code=exit_code,
        files=directory / "files",
        artifacts=tuple(artifacts),
        job_type=job_type,
    )


def find_offline_runs(wandb_dir: str | PathLike[str]) -> list[OfflineRun]:
    """Every ``offline-run-*`` under ``wandb_dir``, oldest first.

    ``wandb_dir`` may be the directory that was passed as ``wandb.init(dir=...)`` / ``WANDB_DIR``
    (the parent of ``wandb/``) or the ``wandb/`` folder itself. A run that cannot be read is
    skipped with an :class:`OfflineRunWarning` naming it, so one bad run never hides the others.
    """
    root = Path(wandb_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    for sub in (
        "wandb",
        ".wandb",
    ):  # wandb falls back to ".wandb" when "wandb" is taken
        if (root / sub).is_dir():
            root = root / sub
            break

    runs: list[OfflineRun] = []
    for directory in sorted(p for p in root.glob("offline-run-*") if p.is_dir()):
        try:
            runs.append(read_offline_run(directory))
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"skipping unreadable wandb offline run {directory}: {exc}",
                OfflineRunWarning,
                stacklevel=2,
            )
    epoch = datetime.min.replace(tzinfo=UTC)
    runs.sort(key=lambda r: (r.started is None, r.started or epoch, r.directory.name))
    return runs
