"""The planner against real-tensor training steps of a tiny Llama, its input checks, JSON and plot.

The reference of every byte count is an independent real step: the model built by transformers from the same
config, the techniques stacked by hand (``MasterWeightAdamW``; ``compose.apply`` for MVAS and DGR; transformers'
own gradient checkpointing), and the whole step run for real (MVASAdamW's update included) under MemTracker. The
planner instead runs fake tensors at three shallow depths, extrapolates to the full depth and accounts MVAS's
update separately.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from macroarch import compose
from macroarch.config import DGRConfig, MacroConfig, MVASConfig
from macroarch.measure.fit import measure_training
from macroarch.optim import MasterWeightAdamW
from macroarch.planner import PlanError, plan
from macroarch.planner.cli import run
from macroarch.planner.slowdown import slowdown

LAYERS, BATCH, SEQ = 5, 2, 16
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
          "num_key_value_heads": 4, "max_position_embeddings": 64, "tie_word_embeddings": False}
NAMES = {"parameters": "weights", "gradients": "gradients", "master_weights": "master",
         "optimizer_state": "optimizer", "activations": "activations"}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def planned(config_file):
    return plan(str(config_file), BATCH, SEQ, techniques="mvas,dgr,checkpoint")


def _real(techniques: frozenset[str]):
    """One real training step of the full tiny Llama with ``techniques``, measured by MemTracker."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")},
                          use_cache=False)
        cfg._attn_implementation = "sdpa"
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(cfg).train()
        finally:
            torch.set_default_dtype(previous)
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
        batch = {"input_ids": ids, "labels": ids}
        if "checkpoint" in techniques:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if "mvas" in techniques:
            config = MacroConfig(mvas=MVASConfig(precision_policy={"*": "fp8"}),
                                 dgr=DGRConfig(group_size=1) if "dgr" in techniques else DGRConfig())
            stack = compose.apply(model, config, loss_fn=lambda m: m(**batch).loss, compute_dtype=torch.bfloat16,
                                  seed=0)
            return model, stack.model, stack.optimizer, batch
        return model, model, MasterWeightAdamW(model.parameters()), batch

    return measure_training(build, lambda runner, batch: runner(**batch).loss, fake=False)


@pytest.mark.parametrize("techniques", [(), ("mvas",), ("mvas", "dgr"), ("checkpoint",)],
                         ids=["adamw", "mvas", "mvas+dgr", "checkpoint"])
def test_bytes_match_a_real_step(planned, techniques):
    name = "+".join(techniques) or "plain"
    got = planned.combination(name)
    real = _real(frozenset(techniques))
    assert got.error is None
    assert "extrapolated in depth" in got.how  # the full depth is predicted, not measured
    for category in ("parameters", "gradients", "master_weights", "optimizer_state"):
        assert got.bytes.categories[NAMES[category]] == real.max_by_category[category], category
    assert got.bytes.categories["activations"] == pytest.approx(real.max_by_category["activations"], rel=0.02)
    assert got.bytes.peak == pytest.approx(real.peak_bytes, rel=0.02)


def test_every_combination_is_planned(planned):
    names = {c.name for c in planned.combinations}
    assert names == {"plain", "mvas", "dgr", "checkpoint", "mvas+dgr", "mvas+checkpoint", "dgr+checkpoint",
                     "mvas+dgr+checkpoint"}
    plain, mvas = planned.combination("plain"), planned.combination("mvas")
    assert mvas.bytes.categories["weights"] < plain.bytes.categories["weights"]
    assert plain.fits is None and planned.cheapest is None  # no budget: bytes only


def test_fit_largest_batch_and_cheapest(config_file):
    plain = plan(str(config_file), 1, SEQ).combination("plain")  # bytes only: no search
    # a budget just above the plain step's peak at batch 1: batch 1 fits, and the search must say so
    budget = plain.bytes.peak + 1
    p = plan(str(config_file), 1, SEQ, budget_gb=budget / 1e9, techniques="mvas")
    c = p.combination("plain")
    assert c.fits and c.headroom == budget - c.bytes.peak
    assert c.largest is not None and c.largest >= 1
    over = plan(str(config_file), c.largest + 1, SEQ, budget_gb=budget / 1e9).combination("plain")
    assert not over.fits  # one more sample does not fit
    m = p.combination("mvas")
    assert m.largest >= c.largest  # MVAS needs fewer bytes per step
    ranked = sorted((x for x in p.combinations if x.fits and x.slowdown.measured), key=lambda x: x.slowdown.ratio)
    assert p.cheapest == ranked[0].name


def test_fits_nowhere_names_the_closest(config_file):
    p = plan(str(config_file), BATCH, SEQ, budget_gb=1e-6, techniques="mvas")
    closest = min(p.combinations, key=lambda c: c.bytes.peak)
    assert p.cheapest is None
    assert "fits nowhere" in p.verdict and closest.name in p.verdict
    assert all(c.largest is None for c in p.combinations)


def test_fsdp2_shards_the_state(config_file):
    p = plan(str(config_file), BATCH, SEQ, devices=4, techniques="fsdp2")
    one, four = p.combination("plain"), p.combination("fsdp2")
    for k in ("weights", "gradients", "master", "optimizer"):
        assert four.bytes.categories[k] == math.ceil(one.bytes.categories[k] / 4)
    assert four.bytes.categories["activations"] == one.bytes.categories["activations"]
    assert four.bytes.peak < one.bytes.peak
    assert any("modelled" in n for n in four.notes) and four.slowdown.ratio is None


def _fails_under_fake_tensors():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.head = nn.Linear(8, 32)

        def forward(self, input_ids, labels):
            h = self.embed(input_ids)
            if h.abs().sum().item() < 0:  # a value read: fake tensors refuse it
                h = -h
            return type("Out", (), {"loss": nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())})

        def get_input_embeddings(self):
            return self.embed

    return DataDependent()


def test_analytic_fallback_is_stated():
    p = plan(f"{__name__}:_fails_under_fake_tensors", 2, 4)
    c = p.combination("plain")
    n = 32 * 8 + 8 * 32 + 32
    assert "analytic fallback" in c.how
    assert c.bytes.categories["weights"] == 2 * n and c.bytes.categories["optimizer"] == 8 * n  # bf16, fp32 m, v


@pytest.mark.parametrize("argv, message", [
    (["no_such_model_xyz", "--seq", "8"], "unknown model"),
    (["{config}", "--seq", "8", "--budget", "0"], "budget"),
    (["{config}", "--seq", "8", "--with", "mvas,zero9"], "unknown technique 'zero9'"),
    (["{bad}", "--seq", "8"], "not a JSON"),
    (["{config}", "--seq", "8", "--gpu", "b300"], "unknown --gpu"),
    (["{config}", "--seq", "8", "--dtype", "fp64"], "--dtype"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, config_file, tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("model_type: llama\n")
    argv = [a.format(config=config_file, bad=bad) for a in argv]
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_plan_error_is_a_value_error():
    with pytest.raises(PlanError, match="batch"):
        plan("llama_10b_tiny", 0, 8)


def test_json_schema_and_plot(config_file, tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert run([str(config_file), "--batch", "2", "--seq", "16", "--gpu", "a100", "--with", "mvas", "--json",
                "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget_bytes"] == 80 * 10**9
    assert {"model", "workload", "combinations", "cheapest", "verdict", "notes"} <= set(out)
    for c in out["combinations"]:
        for key in ("weights", "gradients", "master", "optimizer", "activations", "peak"):
            assert isinstance(c[key], int) and c[key] >= 0, key
        assert c["peak"] <= sum(c[k] for k in ("weights", "gradients", "master", "optimizer", "activations")) * 2
        assert isinstance(c["fits"], bool) and isinstance(c["largest"], int)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slowdowns_are_the_benchmark_files():
    from macroarch.paths import project_root

    runs = json.loads((project_root() / "benchmarks/figures/mvas_avx512.json").read_text())["results"]
    ref = runs["AdamW bf16 + fp32 master"]["step_s"]
    for combo, variant in ((frozenset({"mvas"}), "MVAS"), (frozenset({"mvas", "dgr"}), "MVAS + DGR")):
        ratios = sorted(runs[variant]["step_s"][k] / ref[k] for k in ref)
        s = slowdown(combo)
        assert (s.low, s.ratio, s.high) == pytest.approx((ratios[0], ratios[1], ratios[2]), rel=1e-12)
    assert "median of 11: 0.963x" in (project_root() / "docs/benchmarks.md").read_text()  # the DGR ratio's source
    assert slowdown(frozenset({"checkpoint"})).ratio is None


def test_the_parser_is_built_without_torch():
    import subprocess
    import sys

    code = ("import argparse, sys; from macroarch.planner.cli import TECHNIQUES, add_parser; "
            "add_parser(argparse.ArgumentParser().add_subparsers()); print('torch' in sys.modules, *TECHNIQUES)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    from macroarch.planner.run import TECHNIQUES

    assert out == ["False", *TECHNIQUES]
