"""Notebook 01's harness at toy sizes, against hand-written references (closed forms, explicit loops)."""

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from macroarch.data import MLM_VOCAB_SIZE, PAD_ID, eval_batches, lm_batches, mlm_batches
from macroarch.experiments import gradient_explosion as gx
from macroarch.measure.clipping import steps_to_target
from macroarch.measure.gradients import controlled_stack
from macroarch.models import HCTransformerLM, bert_small_config, build_bert_mlm, composite_gain, mlm_loss


@pytest.fixture(scope="module")
def text():
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(train=torch.randint(0, 256, (20_000,), generator=g),
                           val=torch.randint(0, 256, (5_000,), generator=g))


# ------------------------------------------------------------------------------------------------------ C2
@pytest.mark.parametrize("n_layers", [2, 5])
def test_jacobian_log_rate_matches_the_explicit_jacobian(n_layers):
    stack = controlled_stack(5, 6, 1.3, kind="mlp", generator=0, dtype=torch.float64)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = [m.weight.detach() for m in stack if isinstance(m, torch.nn.Linear)]
    picked = {0, 4} if n_layers == 2 else set(range(5))
    h, logs = x, []
    for i, w in enumerate(weights):  # J = diag(tanh'(W h)) W for (Linear, tanh), W for the last Linear
        pre = h @ w.T
        slope = 1 - torch.tanh(pre) ** 2 if i < 4 else torch.ones_like(pre)
        if i in picked:
            frob_sq = sum(float((slope[b, :, None] * w).square().sum()) for b in range(3))
            logs.append(0.5 * math.log(frob_sq / (3 * 6)))  # mean squared singular value = ||J||_F^2 / k
        h = torch.tanh(pre) if i < 4 else pre
    assert gx.jacobian_log_rate(stack, x, n_layers) == pytest.approx(np.mean(logs), rel=1e-12)


def test_linear_stacks_grow_by_exactly_log_sigma_per_layer():
    stacks = gx.stack_profiles([0.9, 1.0, 1.1], depth=12, width=8, batch=4, jacobian_layers=3, seed=0)
    g = torch.Generator().manual_seed(0)
    torch.randn(4, 8, generator=g, dtype=torch.float64)
    v = torch.randn(4, 8, generator=g, dtype=torch.float64)
    for sigma in (0.9, 1.0, 1.1):
        norms = stacks.norms["linear", sigma]
        expected = v.norm() * sigma ** torch.arange(11, -1, -1, dtype=torch.float64)
        assert torch.allclose(norms, expected, rtol=1e-12)
        assert stacks.fits["linear", sigma].rate == pytest.approx(math.log(sigma), abs=1e-12)
    assert stacks.rel_error("linear") < 1e-10
    # tanh only shrinks the Jacobian: every tanh rate is below log(sigma), so its relative error is not small
    assert all(stacks.fits["mlp", s].rate < math.log(s) for s in (0.9, 1.0, 1.1))
    assert set(stacks.jacobian_rate) == {0.9, 1.0, 1.1}


def test_c2_metrics_texts_and_figure(text):
    stacks = gx.stack_profiles([0.5, 2.0], depth=6, width=4, batch=2, jacobian_layers=2, seed=0)
    transformers = gx.transformer_profiles(text, layers=3, width=16, seq_len=16, batch_size=2, n_batches=1, seed=0)
    assert {k: len(v) for k, v in transformers.norms.items()} == {gx.PRE_LN: 3, gx.POST_LN: 3}
    m = gx.c2_metrics(stacks, transformers)
    assert m["linear_rate_sigma0p5"] == stacks.fits["linear", 0.5].rate
    assert m["rate_rel_error"] == stacks.rel_error("linear")
    assert m["mlp_rate_rel_error"] == max(abs(stacks.fits["mlp", s].rate - math.log(s)) / abs(math.log(s))
                                          for s in (0.5, 2.0))
    assert m["pre_ln_first_over_last"] == pytest.approx(float(transformers.norms[gx.PRE_LN][0]
                                                              / transformers.norms[gx.PRE_LN][-1]))
    texts = gx.c2_texts(stacks, transformers, "toy")
    assert f"{m['mlp_rate_rel_error']:.3f}" in texts["measured_text"] and "rate_rel_error" not in texts["measured_text"]
    assert "tanh stacks" in texts["measured_text"] and "toy corpus" in texts["scale"]
    assert "fitted rate" in gx.c2_table(stacks, transformers)
    assert isinstance(gx.plot_c2(stacks, transformers), Figure)


# ------------------------------------------------------------------------------------------------------ C3
def test_bert_schedule_warms_up_then_decays_linearly():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = gx.bert_schedule(10, 4)(opt)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])


def test_train_unclipped_is_plain_mlm_training_with_the_schedule(text):
    """Bit for bit the loop clipping's probe compares against, written out with mlm_loss (attention mask
    included) and dropout on."""
    config = bert_small_config(MLM_VOCAB_SIZE, hidden=16, layers=1, heads=2, max_len=16, pad_token_id=PAD_ID)
    model = build_bert_mlm(config, seed=0)
    reference = copy.deepcopy(model)
    batches = list(mlm_batches(text.train, 2, 16, seed=0, steps=5))
    make_opt = gx.make_optimizer("AdamW", 1e-2, 0.1)
    losses = gx.train_unclipped(model, make_opt, batches, gx.bert_schedule(5, 2), seed=3)

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 2, max(0.0, (5 - s) / 3)))
    expected = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for batch in batches:
            loss = mlm_loss(reference, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
            expected.append(loss.item())
    assert np.array_equal(losses, np.array(expected))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


@pytest.fixture(scope="module")
def sweep(text):
    return gx.clipping_sweep(text, steps=12, thresholds=[0.5, 1.0, 1e9], hidden=16, layers=1, batch_size=2,
                             seq_len=16, adamw_lr=1e-2, sgd_lr=0.1, warmup_fraction=0.1, seed=0)


def test_a_threshold_never_reached_trains_exactly_like_no_clipping(sweep):
    for name in gx.OPTIMIZERS:
        assert np.array_equal(sweep.traces[name, 1e9].loss, sweep.unclipped[name])
        assert sweep.steps_to_target[name, 1e9] == sweep.steps_to_target[name, None]
        if sweep.steps_to_target[name, None] is not None:  # a run that never gets there counts as steps + 1
            assert sweep.slowdown(name, 1e9) == 1.0
    assert sweep.steps_to_target["SGD", None] is not None


def test_c3_metrics_follow_the_definitions(sweep):
    m = gx.c3_metrics(sweep)
    target = float(np.mean(sweep.unclipped["AdamW"][-10:]))  # 10% of 12 steps is under the 10-step window
    ref = steps_to_target(sweep.unclipped["AdamW"], target, window=10)
    reached = steps_to_target(sweep.traces["AdamW", 1.0].loss, target, window=10)
    assert m["target_loss"] == target
    assert m["convergence_slowdown"] == (reached if reached is not None else 13) / max(1, ref or 12)
    assert m["effective_lr_reduction"] == 1 - np.nanmean(sweep.traces["AdamW", 1.0].update_ratio)
    assert m["SGD_clip0p5_clip_fraction"] == sweep.traces["SGD", 0.5].clipped.mean()
    assert m["AdamW_clip1e+09_clip_fraction"] == 0.0
    texts = gx.c3_texts(sweep, None, layers=1, hidden=16, batch_size=2, seq_len=16, adamw_lr=1e-2, corpus="toy")
    assert f"{m['convergence_slowdown']:.2f}" in texts["measured_text"]
    assert "never" in gx.c3_table(sweep) or "none" in gx.c3_table(sweep)
    assert isinstance(gx.plot_c3(sweep), Figure)


def test_c3_needs_the_graded_threshold(sweep):
    with pytest.raises(ValueError, match="1.0"):
        gx.c3_metrics(gx.ClippingSweep((0.5,), 12, 1, {}, {}, {}, {}, {}))
    assert gx.bert_large_probe(None, 0, 4, 16, 0, "cpu") is None


# ------------------------------------------------------------------------------------------------------ R1
def test_train_residual_records_the_gradient_before_each_step_and_gains_where_asked(text):
    kwargs = dict(steps=3, lr=3e-3, layers=1, width=16, n_streams=2, seq_len=16, batch_size=2, gain_every=2,
                  n_eval_batches=2, seed=0)
    run = gx.train_residual("hc", text, **kwargs)

    torch.manual_seed(0)
    model = HCTransformerLM(256, 16, 1, n_heads=4, max_seq_len=16, residual="hc", n_streams=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    norms = []
    for ids, labels in lm_batches(text.train, 2, 16, seed=0, steps=3):
        model(ids, labels=labels).loss.backward()
        norms.append(float(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()
                                          if p.grad is not None))))
        opt.step()
        opt.zero_grad()
    assert run.grad_norms == pytest.approx(norms, rel=1e-5)
    assert [s for s, _ in run.gains] == [0, 2]
    with torch.no_grad():
        val = np.mean([model(i, labels=l_).loss.item() for i, l_ in eval_batches(text.val, 2, 16, max_batches=2)])
    assert run.val_loss == pytest.approx(val, rel=1e-5)
    assert run.final_gain.peak == pytest.approx(composite_gain(model).peak, rel=1e-5)


def test_r1_metrics_series_and_figure(text):
    runs = gx.residual_runs(text, steps=3, lr=3e-3, layers=1, width=16, n_streams=2, seq_len=16, batch_size=2,
                            gain_every=5, n_eval_batches=1, seed=0)
    m = gx.r1_metrics(runs)
    assert m["hc_over_mhc_gain"] == runs["hc"].peak_gain / runs["mhc"].peak_gain
    assert m["residual_peak_gain_over_training"] == 1.0  # one stream: the mixing matrix is the identity
    rows = gx.r1_series(runs)
    assert len(rows) == 3 * 3 and rows[0] == (0, {"residual_loss": runs["residual"].losses[0],
                                                  "residual_grad_norm": runs["residual"].grad_norms[0],
                                                  "residual_peak_gain": 1.0})
    assert [("mhc_peak_gain" in values) for _, values in rows[-3:]] == [True, False, True]  # steps 0 and last
    assert "HC" in gx.r1_texts(runs, layers=1, width=16, n_streams=2, steps=3, lr=3e-3, corpus="toy")["measured_text"]
    assert isinstance(gx.plot_r1(runs), Figure)
