"""benchmarks/mvas.py: the foreach fp32-master reference, speed ratios, target checks, argument checks. Not timed."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("mvas")


def test_foreach_master_reference_matches_the_per_tensor_one(bench):
    from macroarch.optim import MasterWeightAdamW

    torch.manual_seed(0)
    base = [torch.randn(64, 32), torch.randn(32)]
    runs = []
    for cls in (bench.ForeachMasterAdamW, MasterWeightAdamW):
        params = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in base]
        runs.append((params, cls(params, lr=1e-2, weight_decay=0.1)))
    for step in range(3):
        grads = [torch.randn(t.shape, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16) for t in base]
        for params, opt in runs:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    (mine, opt), (theirs, ref) = runs
    for p, q in zip(mine, theirs):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(opt.state[p]["master"], ref.state[q]["master"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, q, rtol=0, atol=0.02)  # the masters rounded to bf16 (one ulp at most)
        assert float(opt.state[p]["step"]) == 3
        assert p.data_ptr() != opt.state[p]["master"].data_ptr()
    moved = [(p.float() - t.to(torch.bfloat16).float()).abs().max() for p, t in zip(mine, base)]
    assert min(moved) > 0  # the bf16 weights follow their masters


def test_speed_rows_ratios_against_both_references(bench):
    step_s = {1024: {bench.REFERENCE: 1.0, "AdamW fp32": 0.5, "MVAS + DGR": 2.0}, 4096: {"MVAS + DGR": 4.0}}
    rows = bench.speed_rows(["MVAS + DGR", "AdamW fp32"], step_s)
    assert rows[0] == ["MVAS + DGR", "2000", "0.50x", "0.25x", "4000", None, None]
    assert rows[1][1:4] == ["500", "2.00x", "1.00x"]
    assert len(bench.speed_headers(step_s)) == len(rows[0])


def test_target_checks(bench):
    ref = dict(eval_loss=2.0)
    step_s = {1024: {bench.REFERENCE: 0.9, "AdamW fp32": 1.8, "MVAS + DGR": 1.0}}
    ok = dict(bytes_per_param=3.99, eval_loss=2.019)
    checks = dict(bench.target_checks(ok, ref, step_s, 1024, "AdamW fp32"))
    assert len(checks) == 4
    assert all(met for name, met in checks.items() if "fp32" not in name or "master" in name)
    assert checks[">= 0.9x AdamW fp32 at 1024 tokens (1.80x)"]
    bad = dict(bytes_per_param=4.01, eval_loss=2.03)
    checks = dict(bench.target_checks(bad, ref, {1024: {**step_s[1024], "MVAS + DGR": 1.1}}, 1024,
                                      bench.REFERENCE))
    assert len(checks) == 3 and not any(checks.values())  # the fair reference is the bf16 one: checked once


def test_arguments(bench, capsys):
    args = bench.parse_args([])
    assert args.tokens == [1024, 4096, 16384] and args.variants == bench.DEFAULT_VARIANTS
    assert bench.EAGER in bench.parse_args(["--eager-too"]).variants
    args = bench.parse_args(["--tokens", "256,512", "--seq-len", "64", "--only", "MVAS + DGR, AdamW fp32"])
    assert args.tokens == [256, 512] and args.variants == ("MVAS + DGR", "AdamW fp32")
    for argv, message in [(["--tokens", "1000"], "multiple of 128"), (["--only", "SGD"], "unknown variant"),
                          (["--steps", "5", "--warmup", "5"], "must exceed --warmup"),
                          (["--timed-steps", "0"], "--timed-steps 0 must be >= 1")]:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err


def test_lm_step_with_its_phases_timed_is_lm_step(bench):
    from macroarch.experiments.loop import lm_step

    torch.manual_seed(0)
    batch = (torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8)))

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

        def forward(self, input_ids, labels):
            logits = self.head(self.emb(input_ids))
            return type("Out", (), {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())})

    models = [TinyLM(), TinyLM()]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    record = []
    for _ in range(2):
        assert lm_step(models[0], opts[0], batch, record) == lm_step(models[1], opts[1], batch)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q) and p.grad is None
    assert len(record) == 2 and all(len(r) == len(bench.PHASES) and min(r) >= 0 for r in record)
    medians = bench.phase_medians([(0.001, 0.004, 0.002), (0.003, 0.002, 0.002), (0.002, 0.003, 0.008)])
    assert medians == (0.002, 0.003, 0.002)
    assert bench.phase_rows(["MVAS"], {"MVAS": medians}) == [["MVAS", "2.0", "3.0", "2.0", "7.0"]]
