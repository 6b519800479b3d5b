"""macroarch._progress: widget bars in JupyterLab, text in batch runs and terminals; a notice for a long wait."""

import io
import sys
import time
import types

import pytest

from macroarch import _progress
from macroarch._progress import SlowNotice


def test_a_long_wait_says_what_and_how_long(capsys):
    with SlowNotice("compiling the x kernel", after=0.05, detail="first call", prefix="p") as n:
        time.sleep(0.3)
    err = capsys.readouterr().err.splitlines()
    assert n.said and err[0] == "p: compiling the x kernel (first call) ..."
    assert err[1].startswith("p: compiling the x kernel: done in ")


def test_a_short_wait_prints_nothing(capsys):
    with SlowNotice("compiling", after=5) as n:
        pass
    time.sleep(0.05)
    assert not n.said and capsys.readouterr().err == ""


def test_an_error_inside_still_ends_the_notice(capsys):
    with pytest.raises(RuntimeError), SlowNotice("x", after=0.01):
        time.sleep(0.1)
        raise RuntimeError("inside")
    time.sleep(0.05)
    assert "x: done in" in capsys.readouterr().err


def _fake_kernel(monkeypatch):
    shell = type("ZMQInteractiveShell", (), {})()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))


def test_text_outside_a_kernel_and_in_the_runners_kernels(monkeypatch):
    from tqdm.notebook import tqdm_notebook
    from tqdm.std import tqdm as text

    monkeypatch.delenv("MACROARCH_EVIDENCE", raising=False)
    monkeypatch.setitem(sys.modules, "IPython", None)
    bar = _progress.tqdm(range(3), file=io.StringIO())
    assert type(bar) is text and bar.mininterval == 10
    bar.close()
    _fake_kernel(monkeypatch)
    assert _progress.widgets_available()
    monkeypatch.setattr(tqdm_notebook, "__init__", lambda self, *a, **k: None)  # no widget front end here
    assert isinstance(_progress.tqdm(range(3)), tqdm_notebook)
    monkeypatch.setenv("MACROARCH_EVIDENCE", "/tmp/x.ipynb")  # a kernel of macroarch reproduce: evidence as text
    assert not _progress.widgets_available()


def test_the_runners_kernel_variable_is_the_evidence_one():
    from macroarch.repro.tracking import EVIDENCE_ENV

    assert _progress.BATCH_ENV == EVIDENCE_ENV
