"""benchmarks/plot.py: the speeds it draws are the tables' ratios (derived here from the runs' own numbers), the
figure has a column per run, and bad input is named without leaving a file behind. Nothing here is timed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.collections import PathCollection

FOREACH = "torch AdamW fp32 foreach"
REF = "AdamW bf16 + fp32 master"


@pytest.fixture(scope="module")
def plot(load_benchmark):
    return load_benchmark("plot")


def step_run(capability="AVX512", skipped=False):
    """An optimizer-step result as ``optimizer_step.py --out`` writes it (JSON keys are strings)."""
    rows = []
    for threads in (1, 2):
        for numel, ref_s in ((1 << 20, 0.006), (1 << 22, 0.024)):
            rows.append(dict(optimizer=FOREACH, threads=threads, numel=numel, step_s=ref_s / threads,
                             gb_per_s=28 * numel / (ref_s / threads) / 1e9))
            rows.append(dict(optimizer="MVASAdamW fp8 weights (compiled)", threads=threads, numel=numel,
                             step_s=1.25 * ref_s / threads, gb_per_s=8.4 * numel / (1.25 * ref_s / threads) / 1e9))
    if skipped:
        rows.append(dict(optimizer="torchao AdamW8bit", threads=1, numel=1 << 20, skipped="not installed"))
    return dict(config=dict(tensors=1), machine=dict(cpu_model="Test CPU", cpu_capability=capability,
                                                     native_bf16=capability == "AVX512"),
                limit_gb_per_s={"1": 20.0, "2": 40.0}, results=rows)


def train_run():
    """A training-step result as ``mvas.py --json`` writes it."""
    def variant(ms, bytes_per_param, loss):
        return dict(step_s={"1024": ms[0] / 1e3, "4096": ms[1] / 1e3}, bytes_per_param=bytes_per_param,
                    eval_loss=loss)
    return dict(config={}, machine=dict(cpu_model="Test CPU", cpu_capability="AVX512", native_bf16=True),
                reference=REF, fair_reference=REF, targets=dict(bytes_per_param=4.0, eval_loss_gap=0.01, speed=0.9),
                results={"AdamW fp32": variant((300, 1200), 16.0, 2.49), REF: variant((150, 600), 16.0, 2.48),
                         "MVAS + DGR": variant((165, 580), 3.55, 2.43)})


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_optimizer_step_speeds_are_the_tables_ratios(plot):
    data = step_run(skipped=True)
    speeds = plot.step_speeds(data)
    assert "torchao AdamW8bit" not in speeds  # skipped rows have no speed
    mvas = speeds["MVASAdamW fp8 weights (compiled)"]
    for threads in (1, 2):
        for numel in (1 << 20, 1 << 22):
            speed, share = mvas[threads][numel]
            assert speed == pytest.approx(1 / 1.25)
            # 8.4 bytes an element over 1.25x the reference's time, against the thread count's limit
            ref_s = (0.006 if numel == 1 << 20 else 0.024) / threads
            assert share == pytest.approx(8.4 * numel / (1.25 * ref_s) / 1e9 / (20.0 * threads))
            assert speeds[FOREACH][threads][numel][0] == 1.0


def test_optimizer_step_figure_has_a_column_per_run(plot, tmp_path):
    posing = step_run("AVX2")
    posing["machine"]["emulating"] = {"ATEN_CPU_CAPABILITY": "avx2"}
    paths = [write(tmp_path, "a.json", step_run("AVX512")), write(tmp_path, "b.json", posing)]
    fig = plot.figure(paths, ["native"])
    axes = fig.get_axes()
    assert len(axes) == 4  # speed and bandwidth share, for each of the two runs
    top = axes[0]
    assert top.get_title().startswith("native\nTest CPU") and "AVX512, bf16 native" in top.get_title()
    assert axes[1].get_title() == "Test CPU\nAVX2, bf16 emulated\nposing as: ATEN_CPU_CAPABILITY=avx2"
    with pytest.raises(ValueError, match="3 labels for 2 result files"):
        plot.figure(paths, ["a", "b", "c"])
    speeds = [ln.get_ydata() for ln in top.get_lines() if list(ln.get_xdata()) == [1 << 20, 1 << 22]]
    assert len(speeds) == 2 and all(np.allclose(y, 0.8) for y in speeds)  # MVAS on 1 and 2 threads
    assert any(np.allclose(ln.get_ydata(), 1.0) for ln in top.get_lines())  # the reference's line


def test_training_step_figure_shows_speed_bytes_and_loss(plot, tmp_path):
    data = train_run()
    speeds = plot.train_speeds(data)
    assert speeds["MVAS + DGR"] == pytest.approx({1024: 150 / 165, 4096: 600 / 580})
    assert speeds["AdamW fp32"] == pytest.approx({1024: 0.5, 4096: 0.5})
    fig = plot.figure([write(tmp_path, "m.json", data)])
    top, bottom = fig.get_axes()
    assert any(np.allclose(ln.get_ydata(), 0.9) for ln in top.get_lines())  # the recorded target
    points = sorted(tuple(c.get_offsets()[0]) for c in bottom.collections if isinstance(c, PathCollection))
    assert np.allclose(points, [(3.55, 150 / 165), (16.0, 0.5), (16.0, 1.0)])  # bytes/param, speed at 1024
    labels = [t.get_text() for t in bottom.texts]
    assert any(t.startswith("MVAS + DGR") and f"{2.43 / 2.48 - 1:+.1%}" in t for t in labels)


def test_written_whole_or_not_at_all(plot, tmp_path, monkeypatch):
    src = write(tmp_path, "a.json", step_run())
    out = tmp_path / "fig.png"
    plot.main([str(src), "-o", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    def fail(self, fname, **kwargs):
        open(fname, "wb").write(b"half")
        raise RuntimeError("disk full")
    monkeypatch.setattr(plot.Figure, "savefig", fail)
    out2 = tmp_path / "fig2.png"
    with pytest.raises(RuntimeError, match="disk full"):
        plot.save(plot.figure([src]), out2)
    assert not out2.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("case,message", [
    ("missing", "cannot be read"),
    ("not json", "not JSON"),
    ("other json", "neither benchmarks/optimizer_step.py"),
    ("mixed", "one kind of run"),
    ("no reference", "no 'torch AdamW fp32 foreach' row at 1M elements"),
])
def test_bad_input_is_named(plot, tmp_path, capsys, case, message):
    if case == "missing":
        paths = [tmp_path / "nope.json"]
    elif case == "not json":
        paths = [tmp_path / "x.json"]
        paths[0].write_text("{oops")
    elif case == "other json":
        paths = [write(tmp_path, "x.json", {"results": 3})]
    elif case == "mixed":
        paths = [write(tmp_path, "a.json", step_run()), write(tmp_path, "b.json", train_run())]
    else:
        data = step_run()
        data["results"] = [r for r in data["results"] if r["optimizer"] != FOREACH]
        paths = [write(tmp_path, "a.json", data)]
    out = tmp_path / "fig.png"
    with pytest.raises(SystemExit) as e:
        plot.main([*map(str, paths), "-o", str(out)])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_unknown_figure_format_is_named_before_any_work(plot, tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "not-read.json"), "-o", str(tmp_path / "fig.docx")])
    err = capsys.readouterr().err
    assert "docx is not a figure format" in err and "png" in err


def test_a_real_run_plots(plot, load_benchmark, tmp_path):
    """optimizer_step.py's own output, end to end (two cheap optimizers on one small tensor)."""
    bench = load_benchmark("optimizer_step")
    out = tmp_path / "step.json"
    bench.main(["--sizes", "128k", "--threads", "1", "--repeats", "1", "--copy-elements", "1M", "--only",
                f"{FOREACH},CompensatedAdamW fp32", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["reference"] == FOREACH
    row = next(r for r in data["results"] if r["optimizer"] == "CompensatedAdamW fp32")
    ref = next(r for r in data["results"] if r["optimizer"] == FOREACH)
    speed, _share = plot.step_speeds(data)["CompensatedAdamW fp32"][1][1 << 17]
    assert speed == pytest.approx(ref["step_s"] / row["step_s"])
    plot.main([str(out), "-o", str(tmp_path / "step.svg")])
    assert (tmp_path / "step.svg").read_text().lstrip().startswith("<?xml")


def test_only_draws_the_named_and_the_reference(plot, tmp_path, capsys):
    data = train_run()
    fig = plot.figure([write(tmp_path, "m.json", data)], names=["MVAS + DGR"])
    top, bottom = fig.get_axes()
    assert [ln.get_label() for ln in top.get_lines() if not ln.get_label().startswith("_")][0] == "MVAS + DGR"
    assert sum(isinstance(c, PathCollection) for c in bottom.collections) == 2  # MVAS + DGR and the reference
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "m.json"), "-o", str(tmp_path / "f.png"), "--only", "MVAS,nope"])
    assert "--only: ['MVAS', 'nope'] not in these runs" in capsys.readouterr().err
