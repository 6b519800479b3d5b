"""An interactive run's executed notebook (macroarch.repro.interactive) against a stand-in kernel shell.

The stand-in has the parts of ipykernel's ZMQInteractiveShell the recorder uses (``events``, the display
publisher's ``register_hook``, ``display_formatter``, ``parent_header``, IPython's input history); the messages
are the shapes ipykernel sends. The real kernel, in JupyterLab in a browser: tests/notebooks/test_jupyterlab_browser.
"""

from __future__ import annotations

import json
import types

import pytest

from macroarch.repro import interactive
from macroarch.repro.tracking import notebook_problem


class _Shell:
    def __init__(self, history):
        self.callbacks, self.hooks = [], []
        self.events = types.SimpleNamespace(register=lambda name, f: self.callbacks.append((name, f)))
        self.display_pub = types.SimpleNamespace(register_hook=self.hooks.append)
        self.display_formatter = types.SimpleNamespace(format=lambda x: ({"text/plain": repr(x)}, {}))
        self.history_manager = types.SimpleNamespace(input_hist_raw=["", *history])
        self.parent_header = {}

    def run(self, source, count, *, outputs=(), result=None, error=None):
        """One cell as ipykernel runs it: its messages through the hooks, then post_run_cell."""
        msg_id = f"m{count}"
        self.parent_header = {"header": {"msg_id": msg_id}}
        for kind, content in outputs:
            msg = {"header": {"msg_type": kind}, "parent_header": {"msg_id": msg_id}, "content": content}
            for hook in self.hooks:
                assert hook(msg) is msg  # the message still goes to the browser
        info = types.SimpleNamespace(result=result, execution_count=count, error_in_exec=error,
                                     error_before_exec=None, info=types.SimpleNamespace(raw_cell=source))
        for name, f in self.callbacks:
            if name == "post_run_cell":
                f(info)


def _template(tmp_path, monkeypatch):
    nb = {"cells": [{"cell_type": "markdown", "id": "0", "metadata": {}, "source": ["# C4\n", "what it measures"]},
                    {"cell_type": "code", "id": "1", "metadata": {"tags": ["parameters"]}, "execution_count": None,
                     "outputs": [], "source": ['profile: str = "cpu"']},
                    {"cell_type": "code", "id": "2", "metadata": {}, "execution_count": None, "outputs": [],
                     "source": ["run = start_run('C4', profile)"]},
                    {"cell_type": "code", "id": "3", "metadata": {}, "execution_count": None, "outputs": [],
                     "source": ["plot()"]},
                    {"cell_type": "code", "id": "4", "metadata": {}, "execution_count": None, "outputs": [],
                     "source": ["never_run()"]}],
          "metadata": {"kernelspec": {"name": "macroarch", "display_name": "Python 3 (macroarch)"},
                       "papermill": {"end_time": "old"}}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "02_memory_wall.ipynb"
    path.write_text(json.dumps(nb))
    monkeypatch.setenv("JPY_SESSION_NAME", str(path))
    return path


def test_the_recording_is_the_opened_notebook_with_each_cells_last_outputs(tmp_path, monkeypatch):
    _template(tmp_path, monkeypatch)
    # the parameters cell was edited in the browser (not saved) and run, then the cell that starts the run
    shell = _Shell(['profile: str = "ci"', "run = start_run('C4', profile)"])
    rec = interactive._Recorder(shell)
    shell.run("run = start_run('C4', profile)", 2, outputs=[("stream", {"name": "stdout", "text": "a\n"}),
                                                           ("stream", {"name": "stdout", "text": "b\n"})])
    out = tmp_path / "out" / "ci" / "02_memory_wall.ipynb"
    rec.target(out)
    shell.run("plot()", 3, outputs=[("display_data", {"data": {"text/plain": "bar"}, "metadata": {},
                                                      "transient": {"display_id": "d1"}}),
                                    ("update_display_data", {"data": {"text/plain": "bar 2/2"}, "metadata": {},
                                                             "transient": {"display_id": "d1"}}),
                                    ("display_data", {"data": {"image/png": "iVBO"}, "metadata": {}})],
              result=7)
    nb = json.loads(out.read_text())  # rewritten after the cell
    assert [c["cell_type"] for c in nb["cells"]] == ["markdown", "code", "code", "code", "code"]
    md, params, start, plot, never = nb["cells"]
    assert md["source"] == ["# C4\n", "what it measures"]
    assert params["source"] == 'profile: str = "ci"' and params["execution_count"] == 1  # what ran, not the file
    assert params["metadata"] == {"tags": ["parameters"]} and params["outputs"] == []
    assert start["outputs"] == [{"output_type": "stream", "name": "stdout", "text": "a\nb\n"}]
    assert plot["outputs"] == [
        {"output_type": "display_data", "data": {"text/plain": "bar 2/2"}, "metadata": {}},
        {"output_type": "display_data", "data": {"image/png": "iVBO"}, "metadata": {}},
        {"output_type": "execute_result", "execution_count": 3, "data": {"text/plain": "7"}, "metadata": {}}]
    assert never["execution_count"] is None and never["outputs"] == []
    meta = nb["metadata"]
    assert "papermill" not in meta and meta["kernelspec"]["name"] == "macroarch"
    assert meta["macroarch"]["interactive"] and meta["macroarch"]["end_time"] and meta["macroarch"]["exception"] is None
    assert notebook_problem(out) is None  # evidence as a batch run's is
    assert not list(out.parent.glob(".*partial"))


def test_a_last_cell_that_raised_is_no_clean_run_and_a_cell_run_twice_shows_its_last_outputs(tmp_path, monkeypatch):
    _template(tmp_path, monkeypatch)
    shell = _Shell([])
    rec = interactive._Recorder(shell)
    out = tmp_path / "nb.ipynb"
    rec.target(out)
    shell.run("plot()", 1, outputs=[("stream", {"name": "stderr", "text": "first\n"})])
    shell.run("plot()", 2, outputs=[("clear_output", {"wait": False}), ("stream", {"name": "stdout", "text": "x"})])
    nb = json.loads(out.read_text())
    (plot,) = [c for c in nb["cells"] if c["source"] == "plot()"]
    assert plot["execution_count"] == 2 and plot["outputs"] == [{"output_type": "stream", "name": "stdout",
                                                                  "text": "x"}]
    shell.run("1 / 0", 3, error=ZeroDivisionError("division by zero"))
    nb = json.loads(out.read_text())
    extra = nb["cells"][-1]  # run after plot(): the last code cell, edited in the browser (the file holds no such cell)
    assert extra["source"] == "1 / 0" and extra["outputs"][0]["output_type"] == "error"
    assert extra["outputs"][0]["ename"] == "ZeroDivisionError"
    assert notebook_problem(out) == "its last cell raised"


def test_no_recorder_outside_an_interactive_kernel_nor_in_the_runners_kernels(monkeypatch):
    monkeypatch.setattr(interactive, "_RECORDER", None)
    assert interactive.recorder() is None  # pytest: no IPython kernel
    monkeypatch.setenv("MACROARCH_EVIDENCE", "x.ipynb")
    assert interactive._shell() is None


def test_a_recorder_that_breaks_turns_itself_off_with_one_warning_and_never_fails_the_cell(tmp_path, monkeypatch):
    _template(tmp_path, monkeypatch)
    shell = _Shell([])
    rec = interactive._Recorder(shell)
    rec.target(tmp_path / "nb.ipynb")
    monkeypatch.setattr(rec, "notebook", lambda: 1 / 0)
    with pytest.warns(RuntimeWarning, match="not recorded"):
        shell.run("plot()", 1)
    assert rec.off
    shell.run("plot()", 2)  # silent from now on
