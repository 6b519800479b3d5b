"""``import macroarch`` and its techniques print nothing, and the third-party noise they would trigger (torchao's
``register_constant`` deprecation, logged by torch's pytree logger when transformers imports torchao) is dropped
only for torchao's enums: the same record about a user's own enum still shows."""

import subprocess
import sys

import pytest

NOISE = "is an Enum subclass and is now natively supported by torch.compile"


def _stderr(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.slow
def test_importing_the_package_and_its_hf_integration_prints_nothing():
    assert NOISE in _stderr("from transformers import Trainer")  # the noise, without macroarch
    assert _stderr("import macroarch, macroarch.mvas, macroarch.dgr") == ""
    assert _stderr("import macroarch, macroarch.mvas, macroarch.dgr, macroarch.integrations") == ""


@pytest.mark.slow
def test_the_same_record_about_a_users_enum_still_shows():
    code = ("import enum, macroarch, macroarch.integrations\n"
            "from torch.utils._pytree import register_constant\n"
            "class Mine(str, enum.Enum):\n    A = 'a'\n"
            "register_constant(Mine)\n")
    stderr = _stderr(code)
    assert NOISE in stderr and "Mine" in stderr
    assert "KernelPreference" not in stderr and "ScaleCalculationMode" not in stderr
