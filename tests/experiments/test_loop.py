"""The shared training loop and evaluation, against hand-computed references."""

import copy

import pytest
import torch
import torch.nn.functional as F

from macroarch.experiments.loop import evaluate_lm, train_lm, train_round_robin
from macroarch.measure.workload import lm_loss
from macroarch.models import get_model_spec


def _model():
    torch.manual_seed(0)
    return get_model_spec("llama_65b_tiny").build()


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(ids, ids.clone()) for ids in (torch.randint(0, 256, (2, 16), generator=g) for _ in range(n))]


def test_evaluate_lm_is_token_weighted_cross_entropy_and_argmax_accuracy():
    model, batches = _model(), _batches(3)
    result = evaluate_lm(model, batches)
    with torch.no_grad():
        logits = torch.cat([model(input_ids=ids).logits[:, :-1] for ids, _ in batches]).reshape(-1, 256)
        target = torch.cat([labels[:, 1:] for _, labels in batches]).reshape(-1)
    assert abs(result.loss - F.cross_entropy(logits, target).item()) < 1e-5
    assert result.accuracy == (logits.argmax(-1) == target).float().mean().item()
    assert result.tokens == 3 * 2 * 15 and model.training


def test_round_robin_trains_each_model_as_train_lm_would():
    batches = _batches(4)
    a, b = _model(), _model()
    ref = copy.deepcopy(a)
    logs = train_round_robin({"a": (a, torch.optim.SGD(a.parameters(), lr=0.1)),
                              "b": (b, torch.optim.SGD(b.parameters(), lr=0.1))}, batches)
    ref_log = train_lm(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    assert logs["a"].losses == logs["b"].losses == ref_log.losses
    assert len(logs["a"].seconds) == 4 and logs["a"].step_time(skip=1) > 0
    for p, q in zip(a.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_a_custom_step_runs_in_the_same_loop_with_its_callback_and_timing():
    batches, seen = _batches(3), []

    def half_step(model, optimizer, batch):  # the loss of the first half of the rows, no update
        return lm_loss(model, (batch[0][:1], batch[1][:1])).item()

    model = _model()
    log = train_lm(model, None, batches, step=half_step, after_step=lambda i, loss: seen.append((i, loss)))
    with torch.no_grad():
        expected = [model(input_ids=ids[:1], labels=ids[:1]).loss.item() for ids, _ in batches]
    assert log.losses == expected and [i for i, _ in seen] == [0, 1, 2] and len(log.seconds) == 3
    assert log.wall_seconds >= sum(log.seconds) and not log.diverged


def test_a_non_finite_loss_raises_or_stops_the_run():
    losses = iter([1.0, 2.0, float("inf"), 3.0])
    step = lambda model, optimizer, batch: next(losses)  # noqa: E731
    with pytest.raises(FloatingPointError, match="inf at step 2"):
        train_lm(_model(), None, _batches(4), step=step)
    losses, called = iter([1.0, 2.0, float("nan"), 3.0]), []
    log = train_lm(_model(), None, _batches(4), step=step, on_nonfinite="stop",
                   after_step=lambda i, loss: called.append(i))
    assert log.losses == [1.0, 2.0] and log.diverged_at == 2 and called == [0, 1]
    with pytest.raises(ValueError, match="on_nonfinite"):
        train_lm(_model(), None, [], on_nonfinite="ignore")


def test_evaluate_lm_under_autocast_and_with_ignored_labels():
    model, batches = _model(), _batches(2)
    masked = [(ids, torch.where(torch.arange(16) < 8, labels, -100)) for ids, labels in batches]
    result = evaluate_lm(model, masked)
    with torch.no_grad():
        logits = torch.cat([model(input_ids=ids).logits[:, :-1] for ids, _ in batches])
    target = torch.cat([labels[:, 1:] for _, labels in masked])
    keep = target != -100
    assert result.tokens == int(keep.sum()) == 2 * 2 * 7
    assert abs(result.loss - F.cross_entropy(logits[keep], target[keep]).item()) < 1e-5
    bf16 = evaluate_lm(model, batches, autocast_dtype=torch.bfloat16)
    assert abs(bf16.loss - evaluate_lm(model, batches).loss) < 0.05 and bf16.loss != evaluate_lm(model, batches).loss
