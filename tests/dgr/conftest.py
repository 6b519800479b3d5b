"""The model zoo as a fixture: ``zoo[name]() -> (model, loss_fn(model))``."""

import pytest
from model_zoo import ZOO


@pytest.fixture
def zoo():
    return ZOO
