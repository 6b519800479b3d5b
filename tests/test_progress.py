"""macroarch._progress: widget bars in JupyterLab, text in batch runs and terminals; a notice for a long wait (in a
real Jupyter kernel: a display in the cell's output, updated in place, and nothing on stderr)."""

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


def _kernel_messages(code):
    """The iopub messages a real IPython kernel (this interpreter) sends while it executes ``code``."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")
    try:
        msg_id = client.execute(code)
        messages = []
        while True:
            msg = client.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return messages
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.slow
def test_in_a_jupyter_kernel_the_notice_is_a_display_updated_when_done():
    code = ("import time\nfrom macroarch._progress import SlowNotice\n"
            "with SlowNotice('compiling the x kernel', after=0.2, detail='first call', prefix='p'):\n"
            "    time.sleep(1.5)\n")
    messages = _kernel_messages(code)
    kinds = [m["msg_type"] for m in messages]
    assert "error" not in kinds, [m["content"] for m in messages if m["msg_type"] == "error"]
    streams = [m["content"] for m in messages if m["msg_type"] == "stream"]
    assert not [s for s in streams if s["name"] == "stderr"], streams  # JupyterLab's error-coloured box
    (shown,) = [m["content"] for m in messages if m["msg_type"] == "display_data"]
    (done,) = [m["content"] for m in messages if m["msg_type"] == "update_display_data"]
    assert shown["data"] == {"text/plain": "p: compiling the x kernel (first call) ..."}
    assert done["data"]["text/plain"].startswith("p: compiling the x kernel: done in ")
    assert done["transient"]["display_id"] == shown["transient"]["display_id"]  # the same line, updated


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
    bar = _progress.tqdm(range(3))
    assert isinstance(bar, tqdm_notebook)
    bar.disable = True  # never initialised: nothing to close when it is collected
    monkeypatch.setenv("MACROARCH_EVIDENCE", "/tmp/x.ipynb")  # a kernel of macroarch reproduce: evidence as text
    assert not _progress.widgets_available()


def test_the_runners_kernel_variable_is_the_evidence_one():
    from macroarch.repro.tracking import EVIDENCE_ENV

    assert _progress.BATCH_ENV == EVIDENCE_ENV
