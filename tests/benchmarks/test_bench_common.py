"""benchmarks/_common.py: sizes, timing bookkeeping, machine description, tables."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def common(load_benchmark):
    return load_benchmark("_common")


def test_parse_sizes_suffixes_and_errors(common):
    assert common.parse_sizes("1M, 4k,3") == [1 << 20, 4096, 3]
    assert common.parse_sizes("1024,4096,16384", multiple_of=128) == [1024, 4096, 16384]
    for bad, match in [("0", "positive"), ("1.5M", "not a size"), ("1M,1M", "repeats"), ("", "not a size"),
                       ("100", "multiple of 128")]:
        with pytest.raises(ValueError, match=match):
            common.parse_sizes(bad, multiple_of=128)
    with pytest.raises(ValueError, match="--tokens"):
        common.parse_sizes("x", name="--tokens")


def test_format_size_inverts_parse(common):
    for text in ("1M", "64M", "4k", "1G", "1000"):
        assert common.format_size(common.parse_sizes(text)[0]) == text


def test_time_calls(common):
    ticks = iter([0, 10, 10, 11, 11, 14, 14, 16])  # call seconds: 10 (warm-up), 1, 3, 2
    calls = []
    timing = common.time_calls(lambda: calls.append(1), warmup=1, repeats=3, clock=lambda: next(ticks))
    assert len(calls) == 4 and timing.warmup == [10] and timing.times == [1, 3, 2]
    assert timing.median == 2 and timing.first == 10
    with pytest.raises(ValueError, match="repeats"):
        common.time_calls(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        common.time_calls(lambda: None, warmup=True)
    with pytest.raises(ValueError, match="no timed calls"):
        _ = common.Timing().median


def test_cpu_flags_reads_the_speed_flags_in_order(common):
    text = "processor: 0\nflags\t\t: fpu amx_bf16 avx2 sse avx512f avx512_bf16\n"
    assert common.cpu_flags(text) == ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    assert common.cpu_flags("model name: x\n") == []


def test_fair_reference_follows_native_bf16(common):
    assert common.fair_reference({"native_bf16": True}) == "AdamW bf16 + fp32 master"
    assert common.fair_reference({"native_bf16": False}) == "AdamW fp32"


def test_machine_lines_name_the_cpu_and_bf16(common, monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    info = dict(cpu_model="Test CPU", cpu_capability="AVX2", native_bf16=False, native_fp16=False, torch="2.x")
    text = "\n".join(common.machine_lines(info, ["avx2", "fma"]))
    assert "Test CPU" in text and "AVX2" in text and "bf16 emulated" in text and "avx2 fma" in text
    assert "ATEN_CPU_CAPABILITY=avx2" in text


def test_format_table(common):
    text = common.format_table(["name", "x", "y"], [["a", 1.234, None], ["long name", 10, "z"]])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "x", "y"] and set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].startswith("a ") and lines[2].split() == ["a", "1.23", "-"]
    assert len({len(line) for line in lines}) == 1  # columns padded to one width
    with pytest.raises(ValueError, match="row 0 has 2 cells"):
        common.format_table(["a", "b", "c"], [[1, 2]])


def test_write_json_whole_or_not_at_all(common, tmp_path):
    path = tmp_path / "out.json"
    common.write_json(path, {"a": [1, 2.5]})
    assert json.loads(path.read_text()) == {"a": [1, 2.5]}
    with pytest.raises(TypeError):  # not serialisable: the earlier result stays, no partial file beside it
        common.write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": [1, 2.5]}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
