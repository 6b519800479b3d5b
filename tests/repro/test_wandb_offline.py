"""Tests for macroarch.repro.wandb_offline against *real* wandb 0.31 offline runs.

wandb.init is the expensive part (~0.4 s for the first in a process, ~0.06 s after that, plus
~1 s for the crashed run's subprocess), so the runs are made once per module and shared:

* ``made["main"]``  -- a finished run exercising config / history / summary / define_metric;
* ``made["second"]`` -- a later run finished with ``exit_code=3``;
* ``crashed``       -- a run in a subprocess that dies with ``os._exit`` without ``finish()``.

Tests that need to damage a log work on copies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from datetime import UTC, datetime
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

from macroarch.repro.wandb_offline import (  # noqa: E402  (after the importorskip)
    OfflineRun,
    OfflineRunWarning,
    find_offline_runs,
    read_offline_run,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Settings that keep an offline init fast and side-effect free: no console capture (pytest owns
# stdout), no system-stats sampler, no machine/git/code/metadata probing, no job artifact.
FAST_SETTINGS = {
    "console": "off",
    "x_disable_stats": True,
    "x_disable_meta": True,
    "x_disable_machine_info": True,
    "disable_git": True,
    "disable_code": True,
    "save_code": False,
    "disable_job_creation": True,
}

CONFIG = {
    "lr": 0.1 + 0.2,  # 0.30000000000000004: must survive exactly
    "model": {
        "name": "mvas",
        "dims": [64, 128],
        "opt": {"betas": [0.9, 0.999], "eps": 1e-8},
    },
    "seed": 7,
}
LOSSES = [1 / 3, 0.1 + 0.7, 1e-300, 2.5e10]
ACCS = [0.125, 0.5, 2 / 3, 0.875]
VAL = [1 / 7, 2 / 7, 3 / 7, 0.3]
BEST = [5.5, 1.25, 3.0, 4.0]


def _env(root: Path) -> dict[str, str]:
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(root)}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Two finished offline runs in one wandb dir, plus what was written to them."""
    root = tmp_path_factory.mktemp("wandb_runs")
    info: dict = {"root": root}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _env(root).items():
            mp.setenv(key, value)

        before = datetime.now(UTC)
        run = wandb.init(
            mode="offline",
            dir=root,
            project="macroarch-test",
            name="main-run",
            group="grp",
            tags=["t1", "t2"],
            config=CONFIG,
            settings=wandb.Settings(**FAST_SETTINGS),
        )
        try:
            run.define_metric("best_loss", summary="min")
            for loss, acc, val, best in zip(LOSSES, ACCS, VAL, BEST):
                run.log(
                    {"loss": loss, "acc": acc, "val": {"loss": val}, "best_loss": best}
                )
            run.config.update({"late": {"k": [1, 2], "flag": True}})
            run.summary["verdict"] = {
                "grade": "A",
                "score": 0.75,
            }  # a dict value (key="verdict")
            run.summary["verdict"]["extra"] = 1  # a nested assignment (nested_key path)
            run.summary.update(
                {"verdict2/grade": "B"}
            )  # "/" is part of the key, not a path
            run.summary["loss"] = (
                42.0  # an explicit update overrides the last logged loss
            )
            run.summary["tmp"] = 1
            del run.summary["tmp"]
        finally:
            run.finish()
        info["main"] = {"id": run.id, "before": before, "after": datetime.now(UTC)}

        run = wandb.init(
            mode="offline",
            dir=root,
            project="macroarch-test",
            settings=wandb.Settings(**FAST_SETTINGS),
        )
        try:
            run.log({"x": 1})
        finally:
            run.finish(exit_code=3)
        info["second"] = {"id": run.id}
        # finish() returns once wandb-core has *accepted* the exit record, not once it is on
        # disk: under load the tail of the .wandb lands a few ms later. teardown() waits for
        # wandb-core to exit, which closes (and so flushes) every run log. It costs ~3 ms.
        wandb.teardown()

    runs = {r.run_id: r for r in find_offline_runs(root)}
    info["main"]["run"] = runs[info["main"]["id"]]
    info["second"]["run"] = runs[info["second"]["id"]]
    return info


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import wandb
    from macroarch.repro.wandb_offline import read_offline_run

    settings = wandb.Settings(
        **{FAST_SETTINGS!r},
        x_transaction_log_flush_interval=0.05,   # flush the .wandb often (default: every 15 s)
        x_history_value_encoding="json,typed",   # typed values keep 2.0 a float
    )
    run = wandb.init(mode="offline", project="crashy", config={{"depth": {{"n": 3}}}}, settings=settings)
    for i in range(3):
        run.log({{"loss": 2.0 + i, "frac": 1 / 3 + i}})
    print(run.id, flush=True)
    log_dir = os.path.dirname(run.settings.sync_file)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # wait until the rows are on disk, then die hard
        try:
            if len(read_offline_run(log_dir).history) == 3:
                break
        except Exception:
            pass
        time.sleep(0.02)
    os._exit(7)                           # no finish(), no atexit hooks: a crash
    """
)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb_crash")
    env = {
        **os.environ,
        **_env(root),
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }
    script = CRASH_SCRIPT.format(FAST_SETTINGS=FAST_SETTINGS)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 7, proc.stderr
    run_id = proc.stdout.split()[0]
    (run,) = find_offline_runs(root)
    assert run.run_id == run_id
    return run


# --- round trips ------------------------------------------------------------------------------


def test_config_round_trips_nested(made):
    run: OfflineRun = made["main"]["run"]
    assert run.config == {**CONFIG, "late": {"k": [1, 2], "flag": True}}
    assert run.config["lr"] == 0.30000000000000004  # exact, not just close
    assert "_wandb" not in run.config


def test_history_rows_round_trip_exactly(made):
    history = made["main"]["run"].history
    assert [row["_step"] for row in history] == [0, 1, 2, 3]
    for row, loss, acc, val, best in zip(history, LOSSES, ACCS, VAL, BEST):
        assert row["loss"] == loss and row["acc"] == acc and row["best_loss"] == best
        assert row["val"] == {"loss": val}  # a logged dict comes back as a dict
        assert {"_runtime", "_timestamp"} <= row.keys()
    assert history[2]["loss"] == 1e-300 and history[1]["loss"] == 0.7999999999999999


def test_summary_last_value_and_explicit_updates(made):
    summary = made["main"]["run"].summary
    assert summary["loss"] == 42.0  # explicit summary update after the last log wins
    assert summary["acc"] == ACCS[-1]  # otherwise: last logged value
    assert summary["val"] == {"loss": VAL[-1]}
    assert summary["_step"] == 3
    assert summary["best_loss"] == {"min": min(BEST)}  # define_metric(summary="min")
    assert summary["verdict"] == {"grade": "A", "score": 0.75, "extra": 1}
    assert summary["verdict2/grade"] == "B"
    assert "tmp" not in summary and "_wandb" not in summary


def test_identity_fields(made):
    run: OfflineRun = made["main"]["run"]
    assert run.run_id == made["main"]["id"]
    assert (run.project, run.name, run.group, run.tags) == (
        "macroarch-test",
        "main-run",
        "grp",
        ("t1", "t2"),
    )
    assert run.directory.name.startswith(
        "offline-run-"
    ) and run.directory.name.endswith(run.run_id)
    assert run.directory.parent == made["root"] / "wandb"
    assert run.files == run.directory / "files" and run.files.is_dir()
    assert made["main"]["before"] <= run.started <= made["main"]["after"]
    # the .wandb file itself is accepted too
    assert read_offline_run(run.directory / f"run-{run.run_id}.wandb") == run
    second = made["second"]["run"]
    assert (second.name, second.group, second.tags) == (None, None, ())


# --- finished vs crashed ----------------------------------------------------------------------


def test_exit_code_of_finished_runs(made):
    assert made["main"]["run"].exit_code == 0
    assert made["second"]["run"].exit_code == 3


def test_crashed_run_has_no_exit_code_but_keeps_flushed_data(crashed):
    assert crashed.exit_code is None
    assert crashed.project == "crashy"
    assert crashed.config == {"depth": {"n": 3}}
    assert [row["loss"] for row in crashed.history] == [2.0, 3.0, 4.0]
    assert all(
        type(row["loss"]) is float for row in crashed.history
    )  # typed encoding kept 2.0
    assert [row["frac"] for row in crashed.history] == [1 / 3, 1 / 3 + 1, 1 / 3 + 2]
    assert crashed.summary["loss"] == 4.0


def test_truncated_log_reads_up_to_the_tear(made, tmp_path):
    src = made["main"]["run"].directory
    copy = shutil.copytree(src, tmp_path / src.name)
    log = copy / f"run-{made['main']['id']}.wandb"
    data = log.read_bytes()

    log.write_bytes(data[:-3])  # tear the final (exit) record
    torn = read_offline_run(copy)
    assert torn.exit_code is None
    assert (
        torn.history == made["main"]["run"].history
        and torn.config == made["main"]["run"].config
    )

    log.write_bytes(data[:7])  # nothing but the file header: a run that died at once
    empty = read_offline_run(copy)
    assert (empty.run_id, empty.exit_code, empty.history, empty.config) == (
        made["main"]["id"],
        None,
        [],
        {},
    )
    assert empty.started is not None  # falls back to the folder's timestamp


def test_corruption_in_the_middle_is_an_error(made, tmp_path):
    src = made["main"]["run"].directory
    copy = shutil.copytree(src, tmp_path / src.name)
    log = copy / f"run-{made['main']['id']}.wandb"
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0xFF
    log.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum") as excinfo:
        read_offline_run(copy)
    assert str(log) in str(excinfo.value)


# --- listing ----------------------------------------------------------------------------------


def test_find_offline_runs_sorts_by_start_and_skips_bad_runs(made, tmp_path):
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    # Names chosen so that name order is the *reverse* of start order.
    shutil.copytree(
        made["main"]["run"].directory, wandb_dir / "offline-run-29991231_235959-zzz"
    )
    shutil.copytree(
        made["second"]["run"].directory, wandb_dir / "offline-run-20000101_000000-aaa"
    )
    garbage = wandb_dir / "offline-run-20000101_000001-bad"
    garbage.mkdir()
    (garbage / "run-bad.wandb").write_bytes(b"this is not a wandb log")
    no_log = wandb_dir / "offline-run-20000101_000002-nolog"
    no_log.mkdir()

    for where in (tmp_path, wandb_dir):  # parent of wandb/ or wandb/ itself
        with pytest.warns(OfflineRunWarning) as caught:
            runs = find_offline_runs(where)
        assert [r.run_id for r in runs] == [made["main"]["id"], made["second"]["id"]]
        assert runs[0].started < runs[1].started
        messages = " ".join(str(w.message) for w in caught)
        assert str(garbage) in messages and str(no_log) in messages


def test_find_offline_runs_on_the_fixture_dir(made):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runs = find_offline_runs(made["root"])
    assert [r.run_id for r in runs] == [made["main"]["id"], made["second"]["id"]]


# --- errors -----------------------------------------------------------------------------------


def test_paths_that_are_not_offline_runs(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        read_offline_run(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        find_offline_runs(missing)

    empty_dir = tmp_path / "offline-run-20200101_000000-abc"
    empty_dir.mkdir()
    with pytest.raises(FileNotFoundError, match="no run-<id>.wandb"):
        read_offline_run(empty_dir)

    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="notes.txt"):
        read_offline_run(text)

    fake = tmp_path / "run-abc.wandb"
    fake.write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="bad file header") as excinfo:
        read_offline_run(fake)
    assert str(fake) in str(excinfo.value)
