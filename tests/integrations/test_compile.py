"""torch.compile on an MVAS model: one graph for the model (no recompiles per module), the compiled loss is the
eager one, two compiled steps take at most 3x the plain model's, and training falls as the dense model's.

The backend is ``aot_eager``: AOTAutograd traces the forward and backward through MVASWeight's dispatch (what
inductor compiles too) without spending minutes generating C++ on a shared CPU."""

import time

import torch
from model_zoo import even_ids, tiny_llama
from torch._dynamo.backends.registry import lookup_backend

from macroarch import mvas

IDS = even_ids(4)


def _model(managed):
    model = tiny_llama(managed)
    if managed:
        return model, mvas.MVASAdamW(model.parameters(), lr=1e-2, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _compiled_run(managed, steps):
    torch._dynamo.reset()
    model, opt = _model(managed)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=counting)
    with torch.no_grad():
        eager = float(model(input_ids=IDS, labels=IDS).loss)
    losses, start, two_steps = [], time.process_time(), None  # CPU time: other processes on the machine do not count
    for step in range(steps):
        loss = compiled(input_ids=IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if step == 1:
            two_steps = time.process_time() - start
    return losses, eager, len(graphs), two_steps


def test_compiled_mvas_model_one_graph_same_loss_and_about_the_plain_time():
    plain, plain_eager, plain_graphs, plain_time = _compiled_run(False, 8)
    managed, eager, graphs, managed_time = _compiled_run(True, 8)
    assert graphs <= 2 and plain_graphs <= 2, f"{graphs} graphs for the MVAS model ({plain_graphs} plain)"
    assert abs(managed[0] - eager) < 1e-5  # the compiled loss is the eager one (fp4 and fp8 decoded in the graph)
    assert managed_time < 3 * plain_time, f"two compiled steps: {managed_time:.1f} s vs plain {plain_time:.1f} s"
    assert managed[0] - managed[-1] > 0.7 * (plain[0] - plain[-1]) > 0


def test_a_compiled_training_step_that_calls_mvas_adamw_step_runs_it_as_it_is():
    """``torch.compile`` of a function that calls ``opt.step()`` (torch.optim's own optimizers support it): dynamo
    used to fail inside MVASAdamW's step (an InternalTorchDynamoError on views of the packed state); the step is
    excluded from tracing (``torch.compiler.disable``) and runs as it does uncompiled, with the same weights."""
    results = []
    for compile_step in (False, True):
        torch._dynamo.reset()
        model, opt = _model(True)

        def train_step(model=model, opt=opt):
            loss = model(input_ids=IDS, labels=IDS).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = torch.compile(train_step, backend="aot_eager") if compile_step else train_step
        losses = [float(step()) for _ in range(2)]
        weights = [p.detach().clone() if not isinstance(p, mvas.MVASWeight) else p.payload.clone()
                   for p in model.parameters()]
        results.append((losses, weights))
    (plain_losses, plain_weights), (losses, weights) = results
    assert losses == plain_losses
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(plain_weights, weights))
