"""The first MVAS compile imports torch's C++-extension module, which logs "No CUDA runtime is found, using
CUDA_HOME=..." on a machine with a CUDA toolkit and no usable GPU (every notebook's first MVAS step printed it):
``import macroarch`` drops that record (``macroarch._warnings``), and only that one."""

import subprocess
import sys

import pytest

LINE = "No CUDA runtime is found, using CUDA_HOME="


def _stderr(code, tmp_path):
    # a CUDA toolkit where torch looks for one (CUDA_HOME), and no GPU visible: torch's condition for the line
    env = {"CUDA_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.slow
def test_the_no_cuda_runtime_line_is_dropped_and_nothing_else(tmp_path):
    if LINE not in _stderr("import torch.utils.cpp_extension", tmp_path):
        pytest.skip("this torch build does not log the line (built without CUDA)")
    stderr = _stderr("import macroarch, torch.utils.cpp_extension, logging\n"
                     "logging.getLogger('torch.utils.cpp_extension').warning('another record')", tmp_path)
    assert LINE not in stderr
    assert "another record" in stderr
