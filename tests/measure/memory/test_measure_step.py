"""measure_step on a user-written step: gradients and Adam state equal the parameter bytes they mirror."""

import torch

from macroarch.measure.memory import measure_step


def test_measure_step_counts_gradients_and_adam_state_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # Adam's state exists from here on, as in every later step
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mem = measure_step(step, model, opt, x)
    assert mem.max_by_category["parameters"] == param_bytes
    assert mem.max_by_category["gradients"] == param_bytes
    assert mem.max_by_category["optimizer_state"] == 2 * param_bytes
    assert mem.peak_bytes >= 4 * param_bytes and mem.seconds >= 0
