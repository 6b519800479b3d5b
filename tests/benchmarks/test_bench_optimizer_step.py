"""benchmarks/optimizer_step.py: bytes per step from the state each optimizer holds (hand counts), the table,
argument checks. Nothing here is timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

N = 4 * 4096  # elements: whole blocks of the weights (32) and moments (128), above MVASAdamW's 4096 threshold


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("optimizer_step")


def stepped(bench, name, n=N):
    """The optimizer ``name`` of the benchmark after one step on one tensor of ``n`` elements."""
    setup = bench.setups()[name]
    params = bench.build_params([torch.randn(n // bench.ROW, bench.ROW) * 0.02], setup.weights)
    for p in params:
        p.grad = torch.full(p.shape, 1e-3, dtype=torch.float32 if setup.weights == "fp32" else torch.bfloat16)
    opt = setup.make(params)
    with bench.compile_switch(False):  # the eager path: no compilation in a unit test
        opt.step()
    return opt


def test_step_traffic(bench):
    t = bench.step_traffic(weight=4, grad=4, state=8)
    assert (t.read, t.written, t.total) == (16, 12, 28)
    t = bench.step_traffic(weight=2, grad=2, state=12, master=True, read_only=5)
    assert (t.read, t.written) == (2 + 12 + 5, 2 + 12)
    with pytest.raises(ValueError, match="must be >= 0"):
        bench.step_traffic(weight=-1, grad=0, state=0)


def test_fp32_adamw_moves_28_bytes_per_element(bench):
    for name in ("torch AdamW fp32 foreach", "CompensatedAdamW fp32"):
        t = bench.optimizer_traffic(stepped(bench, name))
        # read grad, weight, m, v (4 each) and the fp32 step counter; write weight, m, v and the counter
        assert (t.read, t.written) == (16 * N + 4, 12 * N + 4), name


def test_master_weights_read_the_master_not_the_weight(bench):
    t = bench.optimizer_traffic(stepped(bench, "CompensatedAdamW bf16 + fp32 master"))
    # read bf16 grad (2), master, m, v (12), counter; write master, m, v, the bf16 weight and the counter
    assert (t.read, t.written) == (14 * N + 4, 14 * N + 4)


@pytest.mark.parametrize("fmt,weight_bytes", [("fp8", 1.0), ("fp4", 0.5)])
def test_mvas_bytes_from_the_packed_layout(bench, fmt, weight_bytes):
    name = next(n for n in bench.setups() if n.startswith(f"MVASAdamW {fmt}") and "compiled" not in n)
    t = bench.optimizer_traffic(stepped(bench, name))
    weight = N * weight_bytes + N // 32 * 4  # payload + one fp32 scale per 32 elements
    moments = 2 * (N + N // 128 * 4)  # fp8 m and sqrt(v), one fp32 scale per 128
    assert t.read == 2 * N + weight + moments + 4  # bf16 gradient, counter
    assert t.written == weight + moments + 4
    assert t.total / N == pytest.approx(2 + 2 * (weight_bytes + 0.125) + 4 * (1 + 4 / 128), abs=1e-3)


def test_lookup_tables_are_read_only_and_subclasses_count_their_storage(bench):
    from macroarch.mvas import MVASWeight

    w = MVASWeight.from_dense(torch.randn(256), "fp8_e4m3", 32)
    assert bench.stored_bytes(w) == 256 + 8 * 4
    assert sorted(name for name, _ in bench.plain_tensors(w)) == ["payload", "scales"]
    p = torch.nn.Parameter(torch.zeros(256))
    p.grad = torch.zeros(256)
    state = {"state1": torch.zeros(256, dtype=torch.uint8), "absmax1": torch.zeros(1), "qmap1": torch.zeros(256),
             "step": 3}
    opt = SimpleNamespace(param_groups=[{"params": [p]}], state={p: state})
    t = bench.optimizer_traffic(opt)
    assert t.read == 1024 + 1024 + 256 + 4 + 1024 and t.written == 1024 + 256 + 4


def test_table_rows_ratio_and_bandwidth_share(bench):
    base = dict(numel=1 << 20, threads=1, first_step_s=0.5, ms_per_mparam=1.0, bytes_per_element=28.0)
    results = [dict(base, optimizer=bench.REFERENCE, step_s=0.02, gb_per_s=2.0),
               dict(base, optimizer="x", step_s=0.04, gb_per_s=0.5),
               dict(optimizer="y", numel=1 << 20, threads=1, skipped="not installed")]
    rows = bench.table_rows(results, {1: 4.0})
    assert len(rows[0]) == len(bench.HEADERS)
    assert rows[0][5] == "1.00x" and rows[1][5] == "0.50x"
    assert rows[0][8] == "50%" and rows[1][8] == "12%"
    assert rows[2][3] == "not installed" and rows[2][4] is None
    assert bench.table_rows(results[1:2], {})[0][5] is None  # no reference at that size: no ratio


def test_arguments_are_checked(bench, monkeypatch, capsys):
    args = bench.parse_args(["--sizes", "1M,4M", "--threads", "1", "--only", "CompensatedAdamW fp32"])
    assert args.sizes == [1 << 20, 4 << 20] and args.threads == [1] and args.only == ["CompensatedAdamW fp32"]
    for argv, message in [(["--sizes", "1000"], "multiple of"), (["--only", "SGD"], "unknown optimizer"),
                          (["--warmup", "0"], "must be >= 1"), (["--threads", "0"], "positive int or 'all'")]:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err
    monkeypatch.setattr(bench, "all_threads", lambda: 4)
    assert bench.parse_threads("1,all,4") == [1, 4]


def test_the_bandwidth_limit_is_the_best_measured_so_no_share_exceeds_one(bench):
    base = dict(numel=1 << 22, first_step_s=0.5, ms_per_mparam=1.0, bytes_per_element=28.0, step_s=0.01)
    results = [dict(base, optimizer="torch AdamW fp32 fused", threads=1, gb_per_s=20.0),
               dict(base, optimizer="MVASAdamW fp8 weights (compiled)", threads=1, gb_per_s=1.3),
               dict(base, optimizer="torch AdamW fp32 fused", threads=2, gb_per_s=30.0),
               dict(optimizer="bitsandbytes AdamW8bit", threads=2, numel=1 << 22, skipped="not installed")]
    limits = bench.bandwidth_limits(results, {1: 15.0, 2: 31.0})
    assert limits[1][0] == 20.0 and "torch AdamW fp32 fused at 4M" in limits[1][1] and "15.00" in limits[1][1]
    assert limits[2] == (31.0, "the in-place stream kernels")
    shares = [r[8] for r in bench.table_rows(results[:3], {t: g for t, (g, _) in limits.items()})]
    assert shares == ["100%", "6%", "97%"]


def test_page_faults_of_a_step_are_counted(bench):
    """An optimizer whose step touches 256 fresh pages (an anonymous mmap: the kernel maps each page on its first
    write) shows at least 256 faults a step, the in-place reference fewer; the table prints the mean."""
    import mmap

    class FreshPages(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            with mmap.mmap(-1, 256 * mmap.PAGESIZE) as fresh:
                for page in range(256):
                    fresh[page * mmap.PAGESIZE] = 1

    chosen = {"fresh": bench.Setup("fp32", FreshPages), bench.REFERENCE: bench.setups()[bench.REFERENCE]}
    results = bench.run_size(2 * bench.ROW, 1, chosen, warmup=1, repeats=3)
    # The reference steps in place into the state its warm-up step allocated: no page of it is new, so whatever it
    # faults (the allocator's own pages) stays below the 256 that the fresh optimizer cannot avoid.
    assert results[bench.REFERENCE]["page_faults_per_step"] < 256 <= results["fresh"]["page_faults_per_step"]
    records = [dict(r, optimizer=name, threads=1) for name, r in results.items()]
    assert int(bench.table_rows(records, {})[0][-1]) >= 256
