"""Precision plans: rule semantics and the post's CLIP policy on a real (tiny) open_clip model, budget plans
against cases with a known answer and against brute force, and the tensors that always stay high precision."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from macroarch.mvas import pack, quantization_error, storage_bytes
from macroarch.mvas.plan.policy import plan_for_budget, plan_from_rules
from macroarch.mvas.plan.precision_policy import (
    clip_plan,
    clip_rules,
    parse_precision_policy,
    read_precision_policy,
    split_rules,
)

ROOT = Path(__file__).resolve().parents[3]
HIGH = ("fp16", "fp8_e4m3", "fp4_e2m1")


@pytest.fixture(scope="module")
def clip():
    import open_clip

    torch.manual_seed(0)
    return open_clip.model.CLIP(
        embed_dim=32, vision_cfg=dict(image_size=32, layers=4, width=64, patch_size=8, head_width=32),
        text_cfg=dict(context_length=16, vocab_size=100, width=32, heads=2, layers=2))


def _is_norm_or_bias(name):
    return "ln_" in name or name.endswith("bias")


def test_first_matching_rule_wins(clip):
    rules = [("visual.transformer.resblocks.0.*", "fp4"), ("visual.*", "fp8"), ("*", "fp16")]
    plan = plan_from_rules(clip, rules, min_numel=0, keep_patterns=())
    for name, _ in clip.named_parameters():
        expected = ("fp4_e2m1" if name.startswith("visual.transformer.resblocks.0.")
                    else "fp8_e4m3" if name.startswith("visual.") else "fp16")
        assert plan[name].format == expected, name
    everything_first = plan_from_rules(clip, rules[::-1], min_numel=0, keep_patterns=())
    assert set(everything_first.formats().values()) == {"fp16"}


def test_a_pattern_naming_a_module_covers_its_parameters(clip):
    plan = plan_from_rules(clip, [("visual.transformer.resblocks.1", "fp8")], min_numel=0, keep_patterns=())
    lowered = {n for n, f in plan.formats().items() if f == "fp8_e4m3"}
    assert lowered == {n for n, _ in clip.named_parameters() if n.startswith("visual.transformer.resblocks.1.")}
    assert plan["visual.conv1.weight"].format == "fp32" and plan["visual.conv1.weight"].reason == "no rule"


def test_a_rule_with_an_unknown_format_is_named(clip):
    with pytest.raises(ValueError, match=r"rule 1 \('visual\.\*', 'fp6'\): unknown format 'fp6'"):
        plan_from_rules(clip, [("text.*", "fp16"), ("visual.*", "fp6")])


def test_the_posts_clip_policy(clip):
    policy = read_precision_policy(ROOT / "configs" / "clip_post.yaml")
    assert policy == {"text": ("fp16",), "image": ("fp8_e4m3", "fp16")}
    plan = clip_plan(clip, policy)
    n_blocks = len(clip.visual.transformer.resblocks)
    shallow = {f"visual.transformer.resblocks.{i}." for i in range(math.ceil(n_blocks / 2))}
    for name, p in clip.named_parameters():
        if p.numel() < 4096 or _is_norm_or_bias(name):
            expected = "fp32"  # the model's own dtype
        elif any(name.startswith(s) for s in shallow):
            expected = "fp8_e4m3"
        else:
            expected = "fp16"  # the text tower, the deep image blocks, the image stem and head
        assert plan[name].format == expected, name
    assert plan["logit_scale"].format == "fp32"
    # the plan's bytes are what packing each tensor really takes
    packed = sum(pack(p, plan[n].format, plan[n].block_size).nbytes for n, p in clip.named_parameters())
    assert plan.bytes() == packed
    total = sum(p.numel() for p in clip.parameters())
    assert plan.dense_bytes(torch.float32) == 4 * total == plan.dense_bytes()
    assert plan.reduction(torch.float32) == pytest.approx(1 - packed / (4 * total))
    assert "fp8_e4m3" in plan.describe() and "visual.conv1.weight" in plan.describe(per_tensor=True)


def test_the_clip_text_tower_is_open_clips_text_modules(clip):
    rules = clip_rules(clip, {"text": "fp16"})
    assert [p for p, _ in rules] == ["transformer", "token_embedding", "positional_embedding", "ln_final",
                                     "text_projection"]
    plan = plan_from_rules(clip, rules, min_numel=0, keep_patterns=())
    assert {n for n, f in plan.formats().items() if f == "fp16"} == {
        n for n, _ in clip.named_parameters() if not n.startswith("visual.") and n != "logit_scale"}


def test_policy_keys_and_formats_are_checked():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['vision'\]; allowed: text, image"):
        parse_precision_policy({"text": "fp16", "vision": "fp8"})
    with pytest.raises(ValueError, match=r"precision_policy.image: unknown format 'fp3'"):
        parse_precision_policy({"image": ["fp3", "fp16"]})
    with pytest.raises(ValueError, match="non-empty list"):
        parse_precision_policy({"image": []})


def test_uneven_splits_give_the_shallow_runs_the_extra_block():
    assert split_rules(["a", "b", "c"], ["fp8", "fp16"]) == [("a", "fp8"), ("b", "fp8"), ("c", "fp16")]
    with pytest.raises(ValueError, match="1 blocks cannot be cut into 2 runs"):
        split_rules(["a"], ["fp8", "fp16"])


# ---------------------------------------------------------------------------------------------- budget
def _tensors(n, numel=8192):
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(numel, generator=gen) for i in range(n)}


def test_budget_lowers_the_least_sensitive_tensors_first():
    tensors = _tensors(4)
    sens = {"w0": {"fp16": 0, "fp8_e4m3": 1, "fp4_e2m1": 5}, "w1": {"fp16": 0, "fp8_e4m3": 10, "fp4_e2m1": 50},
            "w2": {"fp16": 0, "fp8_e4m3": 2, "fp4_e2m1": 1000}, "w3": {"fp16": 0, "fp8_e4m3": 100, "fp4_e2m1": 1e3}}
    fp16, fp8 = storage_bytes(8192, "fp16"), storage_bytes(8192, "fp8_e4m3")
    target = 2 * fp16 + 2 * fp8  # room for exactly two tensors in fp8
    plan = plan_for_budget(tensors, sens, target_bytes=target)
    assert plan.formats() == {"w0": "fp8_e4m3", "w1": "fp16", "w2": "fp8_e4m3", "w3": "fp16"}
    assert plan.bytes() <= target and plan.sensitivity == 3


def test_budget_undoes_steps_that_a_later_larger_step_made_unnecessary():
    tensors = {"small": torch.zeros(4096), "large": torch.zeros(65536)}
    sens = {"small": {"fp16": 0, "fp8": 1}, "large": {"fp16": 0, "fp8": 20}}  # small is cheaper per byte saved
    fp16_bytes = 2 * (4096 + 65536)
    plan = plan_for_budget(tensors, sens, target_bytes=fp16_bytes - 10_000, formats=("fp16", "fp8"))
    # greedy takes small (3584 bytes saved, not enough), then large (57344): small is no longer needed
    assert plan.formats() == {"small": "fp16", "large": "fp8_e4m3"} and plan.sensitivity == 20
    assert plan.sensitivity_bound <= 20


def test_budget_matches_brute_force_within_its_bound():
    gen = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.zeros(4096 * (1 + i % 3)) for i in range(5)}
    sens = {n: dict(zip(HIGH, torch.rand(3, generator=gen).cumsum(0).tolist())) for n in tensors}
    sizes = {n: {f: storage_bytes(t.numel(), f) for f in HIGH} for n, t in tensors.items()}
    for reduction in (0.1, 0.3, 0.45, 0.6):
        plan = plan_for_budget(tensors, sens, target_reduction=reduction, baseline=torch.float16)
        target = int((1 - reduction) * 2 * sum(t.numel() for t in tensors.values()))
        best = min(sum(sens[n][f] for n, f in zip(tensors, combo))
                   for combo in itertools.product(HIGH, repeat=len(tensors))
                   if sum(sizes[n][f] for n, f in zip(tensors, combo)) <= target)
        assert plan.bytes() <= target
        assert plan.sensitivity == pytest.approx(sum(sens[n][f] for n, f in plan.formats().items()))
        assert plan.sensitivity_bound - 1e-12 <= best <= plan.sensitivity + 1e-12


def test_without_sensitivity_the_error_proxy_lowers_exactly_representable_tensors_first():
    tensors = _tensors(2)
    tensors["signs"] = torch.where(tensors.pop("w1") > 0, 1.0, -1.0)  # exact in every format: zero error
    target = storage_bytes(8192, "fp16") + storage_bytes(8192, "fp4_e2m1")
    plan = plan_for_budget(tensors, target_bytes=target)
    assert plan.formats() == {"w0": "fp16", "signs": "fp4_e2m1"}
    assert plan.sensitivity == pytest.approx(quantization_error(tensors["w0"], "fp16"))  # the signs cost nothing


def test_an_impossible_budget_states_the_minimum():
    tensors = _tensors(3)
    tensors["norm.weight"] = torch.ones(8192)
    minimum = 3 * storage_bytes(8192, "fp4_e2m1") + 4 * 8192  # the norm stays fp32
    with pytest.raises(ValueError, match=f"below the minimum achievable {minimum} bytes"):
        plan_for_budget(tensors, target_bytes=minimum - 1)
    assert plan_for_budget(tensors, target_bytes=minimum).bytes() == minimum


def test_small_tensors_norms_and_biases_stay_high_precision(clip):
    plan = plan_for_budget(clip, target_reduction=0.6, keep_high=["visual.conv1*"])
    for name, p in clip.named_parameters():
        if p.numel() < 4096 or _is_norm_or_bias(name):
            assert plan[name].format == "fp32" and plan[name].reason.startswith("kept"), name
    assert plan["visual.conv1.weight"].format == "fp16"
    assert plan.bytes() <= 0.4 * plan.dense_bytes()


def test_budget_inputs_are_checked():
    tensors = _tensors(2)
    with pytest.raises(ValueError, match="exactly one of target_reduction and target_bytes"):
        plan_for_budget(tensors)
    with pytest.raises(ValueError, match=r"sensitivity\['w0'\] has no value for format\(s\) \['fp4_e2m1'\]"):
        plan_for_budget(tensors, {n: {"fp16": 0.0, "fp8": 1.0} for n in tensors}, target_reduction=0.5)
    with pytest.raises(ValueError, match="no entry for tensor 'w1'"):
        plan_for_budget(tensors, {"w0": dict.fromkeys(HIGH, 0.0)}, target_reduction=0.5)
    with pytest.raises(ValueError, match="meta/fake"):
        plan_for_budget({"w": torch.empty(8192, device="meta")}, target_reduction=0.5)


def _llama(n_layers):
    from macroarch.models import get_model_spec

    return get_model_spec("llama_65b_tiny").scaled(n_layers=n_layers).build()


def test_transfer_plan_by_relative_depth_and_by_role():
    from macroarch.mvas import transfer_plan

    small, big = _llama(4), _llama(7)
    rules = [("*layers.0.*", "fp16"), ("*layers.3.*", "fp4"), ("*mlp*", "fp8_e5m2"), ("*embed*", "fp16")]
    plan = plan_from_rules(small, rules, min_numel=1024)
    relative = transfer_plan(plan, big, min_numel=1024)
    # layer i of 7 takes layer round(i * 3 / 6) of 4
    for i, j in enumerate([0, 0, 1, 2, 2, 2, 3]):
        for role in ("self_attn.q_proj.weight", "mlp.up_proj.weight"):
            assert relative[f"model.layers.{i}.{role}"].format == plan[f"model.layers.{j}.{role}"].format
    assert relative["model.embed_tokens.weight"].format == "fp16"
    assert relative["lm_head.weight"].format == "fp32"  # kept in its own dtype in the plan, so here too
    assert relative["model.layers.3.input_layernorm.weight"].format == "fp32"  # a norm: kept
    uniform = transfer_plan(plan, big, depth="uniform", min_numel=1024)
    # mlp: fp16 (layer 0), e5m2 (1, 2), fp4 (3) -> e5m2 holds most elements; attention: fp16, kept, kept, fp4 -> kept
    assert {uniform[f"model.layers.{i}.mlp.up_proj.weight"].format for i in range(7)} == {"fp8_e5m2"}
    assert {uniform[f"model.layers.{i}.self_attn.q_proj.weight"].format for i in range(7)} == {"fp32"}
    with pytest.raises(ValueError, match="depth="):
        transfer_plan(plan, big, depth="deepest")
    with pytest.raises(ValueError, match="same family"):
        transfer_plan(plan, {"encoder.weight": torch.zeros(4096)})


def test_importance_plan_spends_the_budget_on_important_tensors():
    from macroarch.mvas import importance_plan

    model = _llama(2)
    named = dict(model.named_parameters())
    star = "model.layers.1.mlp.down_proj.weight"
    importance = {n: torch.full(p.shape, 1e3 if n == star else 1e-3) for n, p in named.items()}
    plan = importance_plan(named, importance, weight_bytes=0.8, min_numel=1024)
    assert plan[star].format == "fp16"
    eligible = [t for t in plan.tensors if not t.reason.startswith("kept")]
    kept = sum(t.nbytes for t in plan.tensors if t.reason.startswith("kept"))
    assert plan.bytes() <= 0.8 * sum(t.numel for t in eligible) + kept
    with pytest.raises(ValueError, match="exactly one of"):
        importance_plan(named, importance)
    with pytest.raises(ValueError, match="no diagonal"):
        importance_plan(named, {}, weight_bytes=1.0)
