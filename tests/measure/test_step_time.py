"""The step-time model against hand-derived arithmetic: Kaplan FLOPs, bytes over bandwidth, ring collectives."""

from dataclasses import replace

import pytest

from macroarch.measure.memory.analytic import activation_terms
from macroarch.measure.step_time import (
    FUSED_BASELINE,
    Device,
    Efficiency,
    Method,
    Traffic,
    Workload,
    activation_bytes,
    best_plan,
    fused_mvas_traffic,
    memory_bytes,
    mixed_precision,
    speedup,
    step_time,
)
from macroarch.models.spec import TransformerShape

SHAPE = TransformerShape(family="llama", n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, d_ff=688,
                         vocab_size=1000, max_seq_len=512, tied_embeddings=False)
RATE, BW = 100e12, 1e12
NO_TRAFFIC = Traffic(activation=0.0, optimizer=0.0, accumulate=0.0)


def device(**kw):
    return Device(**{"name": "test", "matmul_flops": {"bf16": RATE}, "bandwidth": BW, "memory": 80e9, **kw})


def n_params(s):
    h, f, v, L = s.d_model, s.d_ff, s.vocab_size, s.n_layers
    return v * h + L * (4 * h * h + 3 * h * f + 2 * h) + h + v * h


def kaplan_flops(s, tokens, seq):
    """6 x (every matmul weight: q, k, v, o, gate, up, down per layer, and the head) + attention, per token."""
    h, f, L = s.d_model, s.d_ff, s.n_layers
    matmul = L * (4 * h * h + 3 * h * f) + s.vocab_size * h
    return tokens * (6 * matmul + 6 * L * seq * h)


def test_matmul_time_is_kaplan_flops_over_the_rate():
    w = Workload(SHAPE, seq_len=128, micro_batch=4)
    t = step_time(w, mixed_precision(NO_TRAFFIC), device())
    assert t.matmul == pytest.approx(kaplan_flops(SHAPE, 512, 128) / RATE, rel=1e-12)
    assert t.total == pytest.approx(t.matmul) and t.per_token == pytest.approx(t.total / 512)
    half = step_time(w, mixed_precision(NO_TRAFFIC), device(), Efficiency(matmul=0.5))
    assert half.matmul == pytest.approx(2 * t.matmul)


def test_recomputation_adds_one_forward_pass():
    w = Workload(SHAPE, seq_len=128, micro_batch=4)
    plain = step_time(w, mixed_precision(NO_TRAFFIC), device())
    again = step_time(replace(w, recompute=True), mixed_precision(NO_TRAFFIC), device())
    assert again.matmul == pytest.approx(plain.matmul * 4 / 3)  # forward is a third of forward + backward


def test_fp8_matmuls_only_where_the_device_has_them():
    w = Workload(SHAPE, seq_len=128, micro_batch=4)
    m = Method("fp8", 1.0, 2.0, 2.0, NO_TRAFFIC, managed_fraction=1.0, low_precision_fraction=1.0, fp8_matmuls=True)
    without = step_time(w, m, device())
    with_fp8 = step_time(w, m, device(matmul_flops={"bf16": RATE, "fp8": 2 * RATE}))
    attention = 6 * SHAPE.n_layers * 128 * SHAPE.d_model * 512
    assert without.matmul == pytest.approx(kaplan_flops(SHAPE, 512, 128) / RATE)
    assert with_fp8.matmul == pytest.approx(attention / RATE + (kaplan_flops(SHAPE, 512, 128) - attention) / (2 * RATE))


def test_optimizer_dequant_and_accumulation_are_bytes_over_bandwidth():
    n = n_params(SHAPE)
    traffic = Traffic(activation=0.0, optimizer=28.0, dequant=3.0, accumulate=4.0)
    m = Method("m", 1.0, 2.0, 2.0, traffic, managed_fraction=0.5)
    w = Workload(SHAPE, seq_len=128, micro_batch=2, accumulation=3)
    t = step_time(w, m, device(), Efficiency(bandwidth=0.5))
    assert t.optimizer == pytest.approx(28 * n / (BW * 0.5))
    assert t.dequant == pytest.approx(3 * 3.0 * 0.5 * n * 2 / (BW * 0.5))  # 3 micro-steps x 2 materialisations
    assert t.elementwise == pytest.approx(2 * 4.0 * n / (BW * 0.5))  # the gradient buffer, micro-steps 2 and 3
    slow_kernels = replace(m, traffic=replace(traffic, optimizer_efficiency=0.25))
    slow = step_time(w, slow_kernels, device(), Efficiency(bandwidth=0.5))
    assert slow.optimizer == pytest.approx(4 * t.optimizer)


def test_elementwise_traffic_scales_the_saved_activations():
    w = Workload(SHAPE, seq_len=128, micro_batch=2, flash_attention=False, device_type="cpu")
    act = sum(t.total for t in activation_terms(SHAPE, 2, 128, "bf16_mixed", "cpu"))
    t = step_time(w, mixed_precision(Traffic(activation=5.0, optimizer=0.0, accumulate=0.0)), device())
    assert t.elementwise == pytest.approx(5.0 * act / BW)


def test_flash_attention_drops_the_scores_and_recomputation_keeps_layer_inputs():
    eager = activation_bytes(Workload(SHAPE, 128, 2, flash_attention=False))
    flash = activation_bytes(Workload(SHAPE, 128, 2))
    b, s, a, h, L = 2, 128, SHAPE.n_heads, SHAPE.d_model, SHAPE.n_layers
    # eager Llama saves the fp32 softmax (4 B) and its bf16 cast (2 B) per score; flash a 4 B log-sum-exp per row
    assert eager["all"] - flash["all"] == L * (6 * b * a * s * s - 4 * b * a * s)
    ckpt = activation_bytes(Workload(SHAPE, 128, 2, recompute=True))
    per_layer = (flash["all"] - ckpt["held"]) // (L - 1)  # what recomputation frees per layer, beyond its input
    assert ckpt["held"] < flash["all"] and per_layer > 2 * b * s * h
    assert ckpt["all"] == flash["all"]


def test_ddp_all_reduce_is_exposed_beyond_the_backward_it_overlaps():
    n = n_params(SHAPE)
    alpha, link, world = 5e-6, 1e9, 8
    dev = device(link_bandwidth=link, link_latency=alpha)
    w = Workload(SHAPE, seq_len=16, micro_batch=1, world_size=world)
    t = step_time(w, mixed_precision(NO_TRAFFIC), dev)
    ring = 2 * (world - 1) * alpha + 2 * (world - 1) / world * 2 * n / link  # bf16 gradients
    assert t.comm == pytest.approx(ring - 2 / 3 * t.matmul)
    assert t.total == pytest.approx(t.matmul + t.comm)
    with pytest.raises(ValueError, match="no link"):
        step_time(w, mixed_precision(NO_TRAFFIC), device())


def test_host_time_adds_on_a_cpu_and_hides_on_a_gpu():
    traffic = Traffic(activation=0.0, optimizer=0.0, accumulate=0.0, ops_fixed=10, ops_per_layer=100)
    w = Workload(SHAPE, seq_len=128, micro_batch=4)
    cpu = step_time(w, mixed_precision(traffic), device(op_overhead=1e-5, asynchronous=False))
    gpu = step_time(w, mixed_precision(traffic), device(op_overhead=1e-5, asynchronous=True))
    assert cpu.host == pytest.approx((10 + 4 * 100) * 1e-5)
    assert cpu.total == pytest.approx(cpu.matmul + cpu.host)
    assert gpu.total == pytest.approx(max(gpu.matmul, gpu.host))


def test_memory_counts_state_per_parameter_and_dgr_frees_gradients_only_without_accumulation():
    n = n_params(SHAPE)
    w = Workload(SHAPE, seq_len=128, micro_batch=2)
    base = memory_bytes(w, mixed_precision())
    assert base["weights"] + base["gradients"] + base["optimizer_state"] == 16 * n
    macro = Method("macro", 0.9, 2.0, 2.1, fused_mvas_traffic(0.9), managed_fraction=1.0, frees_gradients=True)
    layer = 4 * 256 * 256 + 3 * 256 * 688 + 2 * 256
    assert memory_bytes(w, macro)["gradients"] == 2 * layer
    assert memory_bytes(replace(w, accumulation=2), macro)["gradients"] == 2 * n
    sharded = memory_bytes(replace(w, world_size=4, sharded=True), mixed_precision())
    assert sharded["optimizer_state"] == pytest.approx(12 * n / 4)


def test_best_plan_prefers_no_recompute_and_fewer_micro_steps_and_respects_memory():
    m = mixed_precision()
    roomy = best_plan(SHAPE, m, device(), seq_len=128, batch_per_rank=8)
    assert roomy.workload.accumulation == 1 and not roomy.workload.recompute
    need = 16 * n_params(SHAPE) + activation_bytes(Workload(SHAPE, 128, 1, recompute=True))["held"]
    tight = best_plan(SHAPE, m, device(memory=need * 1.001), seq_len=128, batch_per_rank=8, reserve=0.0)
    assert tight.workload.micro_batch == 1 and tight.workload.recompute and tight.workload.accumulation == 8
    assert best_plan(SHAPE, m, device(memory=need * 0.9), seq_len=128, batch_per_rank=8, reserve=0.0) is None
    assert speedup(roomy, tight) < 1 and speedup(None, roomy) != speedup(None, roomy)  # nan: cannot train


def test_fused_costs_are_what_the_kernels_read_and_write():
    assert FUSED_BASELINE.optimizer == 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2
    t = fused_mvas_traffic(1.125)
    assert t.dequant == 1.125 + 2 and t.optimizer == pytest.approx(2 + 2 * 1.125 + 2 * 2 * (1 + 4 / 128))


@pytest.mark.parametrize("bad", [dict(micro_batch=0), dict(compute="fp16"), dict(seq_len=1.5)])
def test_bad_workloads_are_rejected_by_name(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=key):
        Workload(**{"shape": SHAPE, "seq_len": 128, "micro_batch": 1, **bad})


def test_bad_fractions_are_rejected():
    with pytest.raises(ValueError, match="managed_fraction"):
        Method("m", 1.0, 2.0, 2.0, NO_TRAFFIC, managed_fraction=1.5)
    with pytest.raises(ValueError, match="matmul"):
        Efficiency(matmul=0.0)
    with pytest.raises(ValueError, match="optimizer_efficiency"):
        Traffic(activation=1.0, optimizer=1.0, optimizer_efficiency=2.0)
