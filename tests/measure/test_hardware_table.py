"""The accelerator table: every figure sourced, dense (not sparse) throughputs, the fp8 and ECC facts of C11; this
machine measured; a step counted."""

import time

import pytest
import torch

from macroarch.measure import hardware as hw


@pytest.mark.parametrize("card", list(hw.ACCELERATORS.values()), ids=list(hw.ACCELERATORS))
def test_every_figure_has_a_known_source(card):
    assert card.source("*") in hw.SOURCES
    for name in ("bandwidth_gbs", "fp8_tflops", "ecc", "ecc_capacity_cost", "link_latency_us"):
        assert card.source(name) in hw.SOURCES
    assert card.source("link_latency_us") == "assumed"  # not a published number, and the table says so


def test_throughputs_are_dense_figures():
    """NVIDIA's tensor cores halve their dense rate with each doubling of input width (fp8 -> bf16 -> tf32); a
    figure entered with 2:4 sparsity would break the ladder (sparse figures are twice the dense ones)."""
    for card in hw.ACCELERATORS.values():
        if card.tf32_tflops is not None:
            assert card.half_tflops == pytest.approx(2 * card.tf32_tflops, rel=0.01), card.name
        if card.fp8_tflops is not None:
            assert card.fp8_tflops == pytest.approx(2 * card.half_tflops, rel=0.01), card.name


def test_the_fp8_and_ecc_facts_the_claim_turns_on():
    has_fp8 = {name for name, card in hw.ACCELERATORS.items() if card.has_fp8}
    assert has_fp8 == {"RTX 4090", "H100 SXM5 80GB", "H200 SXM 141GB"}
    assert not any(hw.get_accelerator(name).has_fp8 for name in hw.POST_SPEEDUPS)
    assert not hw.get_accelerator("RTX 3090").has_ecc  # nothing to disable
    for card in hw.ACCELERATORS.values():
        if card.memory_type.startswith("HBM"):
            assert card.ecc_capacity_cost == 0 and card.ecc_bandwidth_cost == 0, card.name
    assert hw.get_accelerator("V100 SXM2 32GB").bf16_tflops is None  # Volta: fp16 tensor cores only


def test_device_takes_ecc_costs_and_the_16_bit_rate():
    card = hw.get_accelerator("RTX 4090")
    off, on = card.device(), card.device(ecc_on=True)
    assert on.memory == pytest.approx(off.memory * (1 - card.ecc_capacity_cost))
    assert off.memory == 24e9 and off.matmul_flops["fp8"] == 330.3e12
    v100 = hw.get_accelerator("V100 SXM2 32GB").device()
    assert v100.matmul_flops["bf16"] == 125e12 and "fp8" not in v100.matmul_flops
    assert hw.get_accelerator("A100 SXM4 80GB").device(ecc_on=True).memory == 80e9


def test_rows_with_unknown_sources_or_no_default_are_rejected():
    row = hw.get_accelerator("A100 SXM4 80GB")
    with pytest.raises(ValueError, match="unknown sources"):
        hw.Accelerator(**{**row.__dict__, "sources": {"*": "a blog"}})
    with pytest.raises(ValueError, match="'\\*' entry"):
        hw.Accelerator(**{**row.__dict__, "sources": {"ecc": "A100 WP"}})
    with pytest.raises(KeyError, match="known"):
        hw.get_accelerator("A100")


def test_table_prints_every_column_and_its_sources():
    rows = hw.table_rows(list(hw.ACCELERATORS.values()))
    assert rows[0] == list(hw.COLUMNS) and len(rows) == len(hw.ACCELERATORS) + 1
    assert all(len(r) == len(hw.COLUMNS) for r in rows)
    a100 = next(r for r in rows if r[0] == "A100 SXM4 80GB")
    assert a100[1] == "312.0" and a100[3] == "-" and a100[7] == "no" and "A100 DS" in a100[-1]
    legend = hw.legend(list(hw.ACCELERATORS.values()))
    assert hw.SOURCES["Volta WP"] in legend and hw.SOURCES["GA102 WP"] in legend


def test_this_machine_is_measured():
    dev = "cpu"
    assert hw.matmul_flops(torch.float32, 64, dev, repeats=2) > 0
    assert hw.copy_bandwidth(1, dev, repeats=2) > 0
    row, overhead = hw.measure_machine(dev, matmul_n=64, copy_mb=1, repeats=2)
    assert row.source("*") == "measured" and row.bf16_tflops > 0 and row.fp32_tflops > 0 and 0 < overhead < 1e-2
    device = hw.machine_device(row, overhead, dev)
    assert not device.asynchronous and device.op_overhead == overhead
    assert hw.clock(torch.device("cpu")) is time.thread_time  # one thread (the tests' fixture): its CPU time


def test_op_counter_counts_matmul_flops_and_data_moved_but_not_views():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    x = torch.randn(3, 5, 7)
    counter = hw.count_ops(lambda: (a @ b, torch.bmm(x, torch.randn(3, 7, 2)), a + 1.0, a.t(), a.view(16, 8)))
    assert counter.flops == 2 * 8 * 16 * 4 + 2 * 3 * 5 * 7 * 2
    assert sorted(((a[0], b[0]) for _, a, b, _ in counter.matmuls)) == [((3, 5, 7), (3, 7, 2)), ((8, 16), (16, 4))]
    # a + 1.0 reads a and writes a new tensor (the scalar is no tensor); randn writes its output; views: nothing
    assert counter.bytes == 2 * a.numel() * 4 + 3 * 7 * 2 * 4
