"""Notebook 05's harness (C7, C1): the variants stacked by compose.apply train exactly as the hand-built stack
does, the fair baseline follows the compute dtype, full-size memory on a tiny stand-in, the accountings, and the
C7 figure's labels."""

import copy
import dataclasses

import pytest
import torch

from macroarch import mvas
from macroarch.dgr import DGRWrapper
from macroarch.experiments import mvas_llama as ml
from macroarch.experiments.loop import train_round_robin
from macroarch.measure.memory import parameter_count
from macroarch.models import get_model_spec
from macroarch.optim import MasterWeightAdamW

SETTINGS = ml.MVASLlamaSettings(layers=2, width=64, heads=2, seq_len=16, batch_size=2, steps=6, lr=2e-3,
                                importance_batches=2, weight_bytes=0.9, replan_every=2, n_eval_batches=1,
                                compute_dtype="bfloat16", device="cpu", big_model="llama_65b_tiny",
                                c1_model="llama_10b_tiny", big_seq_len=32)


def _small(**overrides):
    s = dataclasses.replace(SETTINGS, **overrides)
    spec = get_model_spec("llama_65b_tiny").scaled(n_layers=s.layers, d_model=s.width, n_heads=s.heads,
                                                    n_kv_heads=s.heads, d_ff=160, max_seq_len=s.seq_len)
    torch.manual_seed(0)
    initial = spec.build().to(dtype=getattr(torch, s.compute_dtype))
    g = torch.Generator().manual_seed(0)
    batches = [(ids, ids.clone()) for ids in (torch.randint(0, 256, (2, 16), generator=g) for _ in range(s.steps))]
    return ml.SmallLlama(s, initial, batches, batches[:1])


def test_composed_variants_train_exactly_as_the_hand_built_stack():
    small = _small()
    plan = ml.first_plan(small)
    training = ml.train_variants(small, plan)
    # The stack as notebook 05 used to build it by hand: store, schedule (before DGR's hooks), DGR, MVASAdamW.
    runs, schedules = {}, []
    for dgr in (False, True):
        model = copy.deepcopy(small.initial)
        store = mvas.apply(model, plan)
        schedules.append(mvas.MVASSchedule(store, every=2, warmup=2))
        if dgr:
            w = DGRWrapper(model, group_size=1, example_inputs=dict(input_ids=small.train[0][0],
                                                                    labels=small.train[0][1]))
            runs["MVAS + DGR"] = (w, w.optimizer(mvas.MVASAdamW, lr=2e-3, weight_decay=0.0, seed=0))
        else:
            runs["MVAS"] = (model, mvas.MVASAdamW(model.parameters(), lr=2e-3, weight_decay=0.0, seed=0))
    logs = train_round_robin(runs, small.train, after_step={name: (lambda step, loss, s=s: s.step())
                                                            for name, s in zip(runs, schedules)})
    for name in runs:
        assert training.logs[name].losses == logs[name].losses
    assert [len(s.history) for s in schedules] == [len(training.stacks[n].schedule.history) for n in runs]
    assert isinstance(training.stacks["MVAS + DGR"].model, DGRWrapper)

    assert training.baseline == "AdamW bf16 + fp32 master"
    assert isinstance(training.stacks[training.baseline].optimizer, MasterWeightAdamW)
    m = training.metrics
    assert set(m) >= {"speed_ratio", "accuracy_gap", "small_state_reduction", "replan_moves", "mvas_dgr_accuracy"}
    assert m["small_state_reduction"] > 0.3  # packed weights and fp8 moments against bf16 + fp32 master and moments
    assert "AdamW bf16 + fp32 master" in training.text()


def test_fp32_compute_gives_the_fp32_adamw_baseline():
    small = _small(compute_dtype="float32", steps=3, replan_every=10)
    training = ml.train_variants(small, ml.first_plan(small))
    assert training.baseline == "AdamW fp32" == ml.baseline_name("float32")
    assert type(training.stacks["AdamW fp32"].optimizer) is torch.optim.AdamW
    assert all(p.dtype == torch.float32 for p in training.stacks["AdamW fp32"].module.parameters())


def test_full_size_memory_on_a_tiny_stand_in():
    small = _small(steps=2)
    plan = ml.first_plan(small)
    settings = dataclasses.replace(SETTINGS, depths=(1, 2, 3), big_seq_len=16)
    big = ml.measure_memory(settings, plan, "llama_65b_tiny", dgr=True, check_full_depth=True)  # asserts the fit
    assert big.reduction > 0.3 and big.variant == "MVAS + DGR" and set(big.baseline) == set(ml.MEMORY_CATEGORIES)
    # DGR holds one group's gradients at a time: one of the two layers' (the embeddings and head count too).
    assert big.mvas["gradients"] < big.baseline["gradients"]
    metrics = ml.c1_metrics(big, _fake_training())
    assert metrics["memory_reduction"] == big.reduction and metrics["mvas_dgr_bytes"] == sum(big.mvas.values())
    assert metrics["quality_gap"] == pytest.approx(0.02)


def _fake_training():
    results = {"AdamW fp32": dict(accuracy=0.50, eval_loss=2.0), "MVAS + DGR": dict(accuracy=0.48, eval_loss=2.1)}
    return ml.Training("AdamW fp32", 1, 1, {}, {}, results)


def _big(activations):
    n = parameter_count(get_model_spec("llama_65b").shape)
    cats = dict.fromkeys(ml.MEMORY_CATEGORIES, 0)
    return ml.BigMemory("llama_65b", n, 80, 1, 2048, dict(cats, parameters=16 * n, activations=activations),
                        dict(cats, parameters=4 * n), False, False)


def test_accountings_find_the_one_that_gives_320_gb():
    big = _big(activations=320e9 - 4 * parameter_count(get_model_spec("llama_65b").shape))
    acc = ml.accountings(big)
    assert acc.closest == "weights + grads fp16 + activations" and acc.match
    assert acc.bytes["weights fp16"] == 2 * big.n_params and "MVAS state + activations (measured)" in acc.bytes
    assert not ml.accountings(_big(activations=1e12)).match


def test_the_c7_figure_labels_stand_clear_of_each_other_and_of_their_lines():
    # At the cpu figure's scale (a 1235 GB baseline), labels centred on their lines nearly touched, cut by the lines.
    fig = ml.plot_c7_memory(_big(activations=190e9))
    renderer, ax = fig.canvas.get_renderer(), fig.axes[0]
    labels = {t.get_text(): t.get_window_extent(renderer) for t in ax.texts if t.get_text().startswith("post:")}
    low, high = labels["post: 192 GB"], labels["post: 320 GB"]
    x192, x320 = (ax.transData.transform((x, 0))[0] for x in (192, 320))
    assert low.x1 < x192 < x320 < high.x0  # each label beside its line, on the side away from the other
    assert high.x0 - low.x1 > 20  # pixels of clear space between them
    fig.clf()


@pytest.mark.parametrize("dtype, name", [("float32", "AdamW fp32"), ("bfloat16", "AdamW bf16 + fp32 master")])
def test_baseline_is_named_by_the_compute_dtype(dtype, name):
    assert ml.baseline_name(dtype) == name


def test_settings_name_the_field_that_is_wrong():
    with pytest.raises(ValueError, match="heads"):
        dataclasses.replace(SETTINGS, heads=3)  # does not divide width 64
    with pytest.raises(ValueError, match="importance_batches"):
        dataclasses.replace(SETTINGS, importance_batches=7)  # more than the 6 training batches
    with pytest.raises(ValueError, match="depths"):
        dataclasses.replace(SETTINGS, depths=(2,))  # one depth cannot be extrapolated
