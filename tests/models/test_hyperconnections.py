"""Hyper-Connections: Sinkhorn-Knopp, composite gain against numpy, the residual model against a hand-written
transformer, HC/mHC at init against the residual model, training and state_dict round trips."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from macroarch.models.hyperconnections import (
    RESIDUAL_KINDS,
    HCTransformerLM,
    HyperConnection,
    composite_gain,
    make_connection,
    mixing_matrices,
    sinkhorn_knopp,
)

TINY = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
KINDS_AND_DYNAMIC = [("residual", True), ("hc", True), ("hc", False), ("mhc", True), ("mhc", False)]


def _ids(seed: int = 0, batch: int = 3, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def _model(residual: str, dynamic: bool = True, seed: int = 0, **overrides) -> HCTransformerLM:
    torch.manual_seed(seed)
    return HCTransformerLM(**{**TINY, **overrides}, residual=residual, dynamic=dynamic)


# --- Sinkhorn-Knopp ---


def test_sinkhorn_is_doubly_stochastic_and_converges():
    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(1))
    m = sinkhorn_knopp(logits, iters=20)
    assert (m >= 0).all()
    assert torch.allclose(m.sum(-1), torch.ones(5, 4), atol=1e-5)  # rows are normalised last
    assert torch.allclose(m.sum(-2), torch.ones(5, 4), atol=1e-3)

    def column_error(iters: int) -> float:  # peakier logits converge more slowly
        return float((sinkhorn_knopp(3.0 * logits.double(), iters).sum(-2) - 1).abs().max())

    assert column_error(200) < 1e-3 * column_error(20)


def test_sinkhorn_is_differentiable():
    logits = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sinkhorn_knopp(x, iters=5), (logits,))


def test_sinkhorn_rejects_bad_iters():
    with pytest.raises(ValueError, match="iters"):
        sinkhorn_knopp(torch.zeros(3, 3), iters=0)


# --- composite gain ---


def test_composite_gain_matches_numpy():
    mats = torch.randn(7, 4, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    gain = composite_gain(list(mats))
    product = np.eye(4)
    for depth, h in enumerate(mats.numpy()):
        product = h @ product
        assert gain.forward[depth].item() == pytest.approx(np.abs(product).sum(axis=1).max(), rel=1e-12)
        assert gain.backward[depth].item() == pytest.approx(np.abs(product).sum(axis=0).max(), rel=1e-12)
    assert gain.peak == max(gain.forward.max().item(), gain.backward.max().item())


def test_composite_gain_of_doubly_stochastic_product_is_one():
    logits = torch.randn(24, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    mats = sinkhorn_knopp(logits, iters=200)
    gain = composite_gain(list(mats))
    assert torch.allclose(gain.forward, torch.ones(24, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(gain.backward, torch.ones(24, dtype=torch.float64), atol=1e-9)


def test_residual_model_has_unit_gain():
    model = _model("residual")
    assert [m.tolist() for m in mixing_matrices(model)] == [[[1.0]]] * 4
    assert composite_gain(model).peak == 1.0


# --- models ---


def _reference_forward(model: HCTransformerLM, ids: torch.Tensor) -> torch.Tensor:
    """GPT-2 pre-LN decoder written out by hand (explicit masked softmax attention), on the model's weights."""
    ln = torch.nn.functional.layer_norm
    B, T = ids.shape
    d, nh = model.config.d_model, model.config.n_heads
    x = model.wte.weight[ids] + model.wpe.weight[:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for k in range(0, len(model.layers), 2):
        attn, mlp = model.layers[k].sublayer, model.layers[k + 1].sublayer
        qkv = ln(x, (d,), attn.norm.weight, attn.norm.bias) @ attn.qkv.weight.T + attn.qkv.bias
        q, kk, v = (t.reshape(B, T, nh, d // nh).transpose(1, 2) for t in qkv.split(d, dim=-1))
        scores = (q @ kk.transpose(-1, -2) / math.sqrt(d // nh)).masked_fill(~mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)
        x = x + y @ attn.proj.weight.T + attn.proj.bias
        hidden = ln(x, (d,), mlp.norm.weight, mlp.norm.bias) @ mlp.fc.weight.T + mlp.fc.bias
        x = x + torch.nn.functional.gelu(hidden) @ mlp.proj.weight.T + mlp.proj.bias
    return ln(x, (d,), model.norm.weight, model.norm.bias) @ model.head.weight.T


def test_residual_kind_is_a_standard_pre_ln_transformer():
    model = _model("residual").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, _reference_forward(model, ids), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind,dynamic", [k for k in KINDS_AND_DYNAMIC if k[0] != "residual"])
def test_hyper_connections_at_init_reproduce_the_residual_stream(kind, dynamic):
    # HC paper init (A_r = I, one-hot read, B = 1, zero dynamic weights) and our mHC init keep all n streams
    # equal to the residual model's single stream, given the same sublayer weights.
    residual = _model("residual", seed=0)
    model = _model(kind, dynamic, seed=1)
    result = model.load_state_dict(residual.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(".sublayer." not in key for key in result.missing_keys)
    ids = _ids()
    with torch.no_grad():
        expected = residual.streams(ids).expand(-1, -1, 4, -1)
        torch.testing.assert_close(model.streams(ids), expected, atol=1e-6, rtol=1e-5)


def test_hc_init_follows_the_paper():
    conn = make_connection("hc", torch.nn.Identity(), d_model=8, n_streams=4, layer_index=6)
    assert torch.equal(conn.static_alpha[:, 0], torch.tensor([0.0, 0.0, 1.0, 0.0]))  # reads stream 6 mod 4
    assert torch.equal(conn.residual_matrix(), torch.eye(4))
    assert torch.equal(conn.static_beta, torch.ones(4))


def test_dynamic_mixing_matrix_is_the_token_average_of_the_last_forward():
    torch.manual_seed(3)
    conn = HyperConnection(torch.nn.Identity(), d_model=8, n_streams=4, layer_index=0)
    with torch.no_grad():
        conn.dynamic_alpha_fn.normal_()
        conn.dynamic_alpha_scale.fill_(0.5)
    h = torch.randn(2, 5, 4, 8)
    conn(h)
    normed = torch.nn.functional.layer_norm(h, (8,))
    alpha = conn.static_alpha + 0.5 * torch.tanh(normed @ conn.dynamic_alpha_fn)  # (2, 5, n, n+1)
    expected = alpha[..., 1:].transpose(-1, -2).mean(dim=(0, 1))
    torch.testing.assert_close(conn.residual_matrix(), expected.detach())
    assert not torch.allclose(conn.residual_matrix(), torch.eye(4), atol=1e-2)


@pytest.mark.parametrize("kind,dynamic", KINDS_AND_DYNAMIC)
def test_training_lowers_loss_and_state_dict_round_trips(kind, dynamic):
    model = _model(kind, dynamic)
    ids = _ids(batch=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5

    clone = _model(kind, dynamic, seed=5)
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, model(ids).logits)
    assert len(mixing_matrices(clone)) == 2 * TINY["n_layers"]


def test_loss_is_next_token_cross_entropy():
    model = _model("mhc")
    ids = _ids()
    out = model(ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, TINY["vocab_size"]),
                                                 ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert model(ids).loss is None


@pytest.mark.parametrize(
    "overrides,name",
    [
        ({"n_streams": 0, "residual": "hc"}, "n_streams"),
        ({"residual": "highway"}, "residual"),
        ({"n_heads": 5}, "n_heads"),
        ({"sinkhorn_iters": 0, "residual": "mhc"}, "sinkhorn_iters"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_bad_arguments_are_rejected(overrides, name):
    kwargs = {**TINY, **overrides}
    with pytest.raises(ValueError, match=name) as info:
        HCTransformerLM(**kwargs)
    if name == "residual":
        assert all(kind in str(info.value) for kind in RESIDUAL_KINDS)


def test_too_long_input_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        _model("hc")(_ids(seq=TINY["max_seq_len"] + 1))
