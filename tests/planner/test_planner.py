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
from model_zoo import in_bf16
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


COMPARED = ("plain", "mvas", "mvas+dgr", "checkpoint", "mvas+master", "mvas+checkpoint")


@pytest.fixture(scope="module")
def planned(config_file):
    return plan(str(config_file), BATCH, SEQ, combinations=COMPARED)


def _real(techniques: frozenset[str]):
    """One real training step of the full tiny Llama with ``techniques``, measured by MemTracker."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")},
                          use_cache=False)
        cfg._attn_implementation = "sdpa"
        model = in_bf16(lambda: LlamaForCausalLM(cfg))
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
        batch = {"input_ids": ids, "labels": ids}
        if "checkpoint" in techniques:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if "mvas" in techniques:
            mvas = MVASConfig(precision_policy={"*": "fp8"}, master_weights="master" in techniques)
            config = MacroConfig(mvas=mvas, dgr=DGRConfig(group_size=1) if "dgr" in techniques else DGRConfig())
            stack = compose.apply(model, config, loss_fn=lambda m: m(**batch).loss, compute_dtype=torch.bfloat16,
                                  seed=0)
            return model, stack.model, stack.optimizer, batch
        return model, model, MasterWeightAdamW(model.parameters()), batch

    return measure_training(build, lambda runner, batch: runner(**batch).loss, fake=False)


def _assert_matches(got, real):
    assert got.error is None
    assert "extrapolated in depth" in got.how  # the full depth is predicted, not measured
    for category in ("parameters", "gradients", "master_weights", "optimizer_state"):
        assert got.bytes.categories[NAMES[category]] == real.max_by_category[category], category
    assert got.bytes.categories["activations"] == pytest.approx(real.max_by_category["activations"], rel=0.02)
    assert got.bytes.peak == pytest.approx(real.peak_bytes, rel=0.02)


@pytest.mark.parametrize("name", COMPARED)
def test_bytes_match_a_real_step(planned, name):
    techniques = frozenset() if name == "plain" else frozenset(name.split("+"))
    got = planned.combination(name)
    real = _real(techniques)
    _assert_matches(got, real)
    if "master" in techniques:
        assert got.bytes.categories["master"] > 0
    assert got.bytes.phase == real.peak_phase


def test_stand_in_update_matches_a_real_step(config_file, monkeypatch):
    """MVASAdamW's update stood in for (``fake_step``: the per-shape temporaries of one real update, allocated where
    the update would run), as for models of more than ``REAL_UPDATE_CALLS`` update chunks, against real steps."""
    from macroarch.planner import run as planner_run

    stood_in = []
    real_stand_in = planner_run._stand_in_step

    def counting(optimizer, temporaries):
        stood_in.append(optimizer)
        return real_stand_in(optimizer, temporaries)

    monkeypatch.setattr(planner_run, "REAL_UPDATE_CALLS", 0)
    monkeypatch.setattr(planner_run, "_stand_in_step", counting)
    p = plan(str(config_file), BATCH, SEQ, combinations=("mvas", "mvas+dgr"))
    assert stood_in  # the stand-in ran
    for name in ("mvas", "mvas+dgr"):
        _assert_matches(p.combination(name), _real(frozenset(name.split("+"))))


def test_every_combination_is_planned(config_file):
    p = plan(str(config_file), BATCH, SEQ, techniques="dgr,checkpoint")
    assert [c.name for c in p.combinations] == ["plain", "dgr", "checkpoint", "dgr+checkpoint"]
    plain, dgr = p.combination("plain"), p.combination("dgr")
    assert dgr.bytes.categories["gradients"] < plain.bytes.categories["gradients"]  # freed group by group
    assert plain.fits is None and p.cheapest is None  # no budget: bytes only
    with pytest.raises(PlanError, match="'master'.*needs 'mvas'"):
        plan(str(config_file), BATCH, SEQ, combinations=["master"])


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
    # the committed benchmark's MVAS range: where it straddles the plain step's 1, MVAS is no cheaper than plain
    low, high = m.slowdown.low, m.slowdown.high
    if low <= 1 <= high:
        assert p.cheapest == "plain" and "tied" in p.verdict and "mvas" in p.verdict.split("tied")[1]
    else:
        assert p.cheapest == ("mvas" if high < 1 else "plain")


def _combo(name: str, ratio: float | None, low: float | None = None, high: float | None = None, peak: int = 10):
    from macroarch.planner.core import Combination
    from macroarch.planner.run import Bytes
    from macroarch.planner.slowdown import Slowdown

    techniques = () if name == "plain" else tuple(name.split("+"))
    low = ratio if low is None else low
    high = ratio if high is None else high
    return Combination(techniques, Bytes({}, peak), "", fits=True, slowdown=Slowdown(ratio, low, high, "test"))


def test_cheapest_tells_apart_only_ratios_whose_ranges_do_not_overlap():
    from macroarch.planner.core import cheapest

    plain, tied, slower = _combo("plain", 1.0), _combo("mvas", 0.95, 0.87, 1.04), _combo("dgr", 1.2, 1.1, 1.3)
    best, ties = cheapest([tied, slower, plain])
    assert best is plain and ties == [tied]  # 0.87-1.04 straddles 1: no measured difference
    faster = _combo("mvas", 0.8, 0.75, 0.9)
    assert cheapest([plain, faster, slower]) == (faster, [])  # wholly below 1
    overlapping = _combo("mvas+dgr", 1.06, 0.98, 1.15)
    assert cheapest([tied, overlapping]) == (tied, [overlapping])  # tied: the fewer techniques is named
    assert cheapest([_combo("checkpoint", None)]) == (None, [])  # unmeasured: never cheapest


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
    (["{config}", "--seq", "8", "--budget", "inf"], "finite"),
    (["{config}", "--seq", "8", "--with", "mvas,zero9"], "unknown technique 'zero9'"),
    (["{bad}", "--seq", "8"], "not a JSON"),
    (["{config}", "--seq", "8", "--gpu", "b300"], "unknown --gpu"),
    (["{config}", "--seq", "8", "--dtype", "fp64"], "--dtype"),
    (["{config}", "--seq", "8", "--plot", "{tmp}/no/such/folder/p.png"], "does not exist"),
    (["{config}", "--seq", "8", "--points", "64"], "point-cloud"),
    (["{config}", "--seq", "8", "--frames", "8"], "video"),
    (["{config}", "--seq", "8", "--search", "frames", "--budget", "1"], "does not apply"),
    (["{config}", "--batch", "two"], "invalid int value"),
    (["{config}", "--seq", "8", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ([], "required: model"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, config_file, tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("model_type: llama\n")
    argv = [a.format(config=config_file, bad=bad, tmp=tmp_path) for a in argv]
    try:
        status = run(argv)
    except SystemExit as e:  # argparse's own errors exit from the parser
        status = e.code
    assert status == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err and captured.out == ""


def test_plan_error_is_a_value_error():
    with pytest.raises(PlanError, match="batch"):
        plan("llama_10b_tiny", 0, 8)


def test_json_schema_and_plot(config_file, tmp_path, capsys):
    from macroarch.planner.core import _budget
    from macroarch.planner.report import figure
    from macroarch.repro.figures import figure_problems

    assert _budget("a100", None)[0] == _budget("A100 SXM4 80GB", None)[0] == 80 * 10**9
    png = tmp_path / "plan.png"
    assert run([str(config_file), "--batch", "2", "--seq", "16", "--with", "mvas", "--json", "--plot", str(png)]) == 0
    assert json.loads(capsys.readouterr().out)["budget_bytes"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    p = plan(str(config_file), 2, 16, budget_gb=0.02, techniques="mvas")
    out = json.loads(json.dumps(p.to_json()))
    assert {"model", "workload", "combinations", "cheapest", "verdict", "notes"} <= set(out)
    for c in out["combinations"]:
        for key in ("weights", "gradients", "master", "optimizer", "activations", "peak"):
            assert isinstance(c[key], int) and c[key] >= 0, key
        # the categories at the peak add up to it; the state is alive through the whole step, so the peak holds
        # all of it, and none of the five categories can be larger at the peak than at its own maximum
        assert c["peak"] == sum(c["at_peak"].values())
        assert c["peak"] >= c["weights"] + c["master"] + c["optimizer"]
        for tracked, category in NAMES.items():
            assert c["at_peak"][tracked] <= c[category], category
        assert c["peak_phase"] in ("setup", "forward", "backward", "backward_tail", "optimizer")
        assert isinstance(c["fits"], bool) and isinstance(c["largest"], int)
        assert isinstance(c["slowdown_source"], str) and c["slowdown_source"]
    assert figure_problems(figure(p)) == []


def test_slowdowns_are_the_benchmark_files():
    from macroarch.paths import project_root
    from macroarch.planner.slowdown import MVAS_RUNS

    runs = json.loads((project_root() / MVAS_RUNS).read_text())["results"]
    for recipe, reference in (("bf16_mixed", "AdamW bf16 + fp32 master"), ("fp32", "AdamW fp32")):
        ref = runs[reference]["step_s"]
        for combo, variant in ((frozenset({"mvas"}), "MVAS"), (frozenset({"mvas", "dgr"}), "MVAS + DGR")):
            ratios = sorted(runs[variant]["step_s"][k] / ref[k] for k in ref)
            s = slowdown(combo, recipe)
            assert (s.low, s.ratio, s.high) == pytest.approx((ratios[0], ratios[len(ratios) // 2], ratios[-1]),
                                                             rel=1e-12)
            assert MVAS_RUNS in s.source and repr(variant) in s.source and repr(reference) in s.source
    for unmeasured in ({"dgr"}, {"checkpoint"}, {"mvas", "master"}):
        assert slowdown(frozenset(unmeasured)).ratio is None  # no committed run: no ratio typed in instead


def test_slowdowns_without_the_benchmark_file(tmp_path, monkeypatch):
    from macroarch.planner import slowdown as module

    monkeypatch.setattr(module, "_root", lambda: tmp_path)
    s = slowdown(frozenset({"mvas"}))
    assert s.ratio is None and "not here" in s.source


def test_the_parser_is_built_without_torch():
    import subprocess
    import sys

    code = ("import argparse, sys; from macroarch.planner.cli import SEARCHES, TECHNIQUES, add_parser; "
            "add_parser(argparse.ArgumentParser().add_subparsers()); "
            "print('torch' in sys.modules, *TECHNIQUES, '|', *SEARCHES)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    from macroarch.planner.core import SEARCHES
    from macroarch.planner.run import TECHNIQUES

    assert out == ["False", *TECHNIQUES, "|", *SEARCHES]
