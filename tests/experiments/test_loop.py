"""The shared training loop and evaluation, against hand-computed references."""

import copy

import torch
import torch.nn.functional as F

from macroarch.experiments.loop import evaluate_lm, train_lm, train_round_robin
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
