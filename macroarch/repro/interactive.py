"""An interactive run's executed notebook, saved as evidence the way a batch run's is.

Under ``macroarch reproduce`` papermill writes each executed notebook to ``papermill_runs/out/<profile>/``, and the
paper copies it into ``evidence/``. In JupyterLab the outputs live in the browser until the user saves, and the
saved file is the user's working copy, not a record of one run. So a kernel that opens a run records what it
executes itself, from ipykernel's public message hooks: each cell's source and execution count (IPython's
``post_run_cell``), the outputs the kernel publishes for it (displays and figures through the display
publisher's hooks, streams through the output streams' hooks, registered on the IO thread that sends them), its
result and its error. Once a run of this kernel has finished, the recording is written, after every cell, as an
nbformat 4 notebook ``papermill_runs/out/<profile>/<notebook>.ipynb``: the notebook the kernel was opened on
(``JPY_SESSION_NAME``, set by jupyter_server) as the template, its markdown kept, each code cell with the outputs
of its last execution (a cell edited before it ran is matched by position), cells run that the file does not
hold appended. ``metadata.macroarch`` says it is interactive, when it started and ended, and the error of the
last cell, if it raised; :func:`macroarch.repro.tracking.notebook_problem` accepts it as a clean run then.

Limits: outputs of cells run before the first ``start_run`` of the kernel are not recorded (their sources are,
from IPython's history); widgets are saved without their state, as in a batch run; the W&B evidence artifact,
logged when the run finishes, does not carry this notebook. Recording never fails a cell: an exception in it
turns the recorder off with one warning.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

_OUTPUT_TYPES = ("stream", "display_data", "update_display_data", "clear_output")
_RECORDER: _Recorder | None = None


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _shell() -> Any:
    """The interactive kernel's shell, or None (a terminal, a script, a batch kernel of the runner)."""
    from macroarch._progress import BATCH_ENV

    if os.environ.get(BATCH_ENV):
        return None
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell if shell is not None and type(shell).__name__ == "ZMQInteractiveShell" else None


def _msg_id(parent: Any) -> str | None:
    if not isinstance(parent, dict):
        return None
    header = parent.get("header", parent)
    return header.get("msg_id") if isinstance(header, dict) else None


class _Recorder:
    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.started = _now()
        self.lock = threading.Lock()
        self.outputs: dict[str, list[dict]] = {}  # parent msg_id -> nbformat outputs
        self.cells: list[dict] = []  # in execution order: source, execution_count, msg_id, outputs
        self.targets: dict[Path, None] = {}  # the files to (re)write after every cell
        self.off = False
        history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None) or []
        for n, source in enumerate(history[1:], 1):  # cells run before: their sources, not their outputs
            self.cells.append({"source": source, "execution_count": n, "msg_id": None, "extra": [],
                               "error": None})
        shell.events.register("post_run_cell", self._after_cell)
        shell.display_pub.register_hook(self._hook)
        for stream in (sys.stdout, sys.stderr):
            pub = getattr(stream, "pub_thread", None)
            if pub is not None and hasattr(stream, "register_hook"):  # its hooks live on the thread that sends
                pub.schedule(lambda s=stream: s.register_hook(self._hook))

    # --- what the kernel publishes ---

    def _hook(self, msg: dict) -> dict:
        try:
            if not self.off:
                self._capture(msg)
        except Exception as e:  # noqa: BLE001 - recording must never break the user's output
            self._stop(e)
        return msg

    def _capture(self, msg: dict) -> None:
        kind = msg.get("header", {}).get("msg_type") or msg.get("msg_type")
        if kind not in _OUTPUT_TYPES:
            return
        content = msg.get("content", {})
        with self.lock:
            outs = self.outputs.setdefault(_msg_id(msg.get("parent_header")) or "", [])
            if kind == "clear_output":
                outs.clear()
            elif kind == "stream":
                if outs and outs[-1]["output_type"] == "stream" and outs[-1]["name"] == content.get("name"):
                    outs[-1]["text"] += content.get("text", "")
                else:
                    outs.append({"output_type": "stream", "name": content.get("name", "stdout"),
                                 "text": content.get("text", "")})
            else:
                display_id = (content.get("transient") or {}).get("display_id")
                out = {"output_type": "display_data", "data": dict(content.get("data") or {}),
                       "metadata": dict(content.get("metadata") or {})}
                if kind == "update_display_data":
                    for i, old in enumerate(outs):
                        if old.get("_display_id") == display_id:
                            outs[i] = {**out, "_display_id": display_id}
                    return
                outs.append({**out, "_display_id": display_id} if display_id else out)

    # --- each cell ---

    def _after_cell(self, result: Any) -> None:
        if self.off:
            return
        try:
            self._record(result)
            self.write()
        except Exception as e:  # noqa: BLE001
            self._stop(e)

    def _record(self, result: Any) -> None:
        kernel = getattr(self.shell, "kernel", None)
        parent = kernel.get_parent() if kernel is not None and hasattr(kernel, "get_parent") else None
        msg_id = _msg_id(parent) or _msg_id(getattr(self.shell, "parent_header", None)) or ""
        extra: list[dict] = []
        if result.result is not None:
            data, metadata = self.shell.display_formatter.format(result.result)
            extra.append({"output_type": "execute_result", "execution_count": result.execution_count,
                          "data": data, "metadata": metadata})
        error = result.error_in_exec or result.error_before_exec
        if error is not None:
            extra.append({"output_type": "error", "ename": type(error).__name__, "evalue": str(error),
                          "traceback": traceback.format_exception(type(error), error, error.__traceback__)})
        self.cells.append({"source": result.info.raw_cell if result.info is not None else "",
                           "execution_count": result.execution_count, "msg_id": msg_id, "extra": extra,
                           "error": f"{type(error).__name__}: {error}" if error is not None else None})

    def target(self, path: Path) -> None:
        """Write the recording to ``path`` now and after every cell from now on."""
        self.targets[Path(path)] = None
        with contextlib.suppress(Exception):
            self.write()

    # --- the notebook ---

    def notebook(self) -> dict:
        for stream in (sys.stdout, sys.stderr):  # what the cells printed has reached the hooks
            with contextlib.suppress(Exception):
                stream.flush()
        with self.lock:
            executed = [{**c, "outputs": [{k: v for k, v in o.items() if k != "_display_id"}
                                          for o in self.outputs.get(c["msg_id"], [])] + c["extra"]}
                        for c in self.cells]
        last = {c["source"].strip(): i for i, c in enumerate(executed)}  # each source's last execution
        finals = sorted(last.values())
        template = _template()
        code = [k for k, c in enumerate(template["cells"]) if c.get("cell_type") == "code"]
        exact = {k: last.get(_source(template["cells"][k]).strip()) for k in code}
        spare = [i for i in finals if i not in exact.values()]  # run from a cell edited in the browser
        chosen: dict[int, int | None] = {}
        for n, k in enumerate(code):  # an edited cell: the first spare run between its neighbours' runs
            if exact[k] is not None:
                chosen[k] = exact[k]
                continue
            lo = max((chosen[j] for j in code[:n] if chosen[j] is not None), default=-1)
            hi = min((exact[j] for j in code[n + 1:] if exact[j] is not None), default=len(executed))
            chosen[k] = next((i for i in spare if lo < i < hi), None)
            if chosen[k] is not None:
                spare.remove(chosen[k])
        cells, placed = [], set()
        for k, cell in enumerate(template["cells"]):
            cell = dict(cell)
            if k in chosen:
                i = chosen[k]
                if i is None:
                    cell.update(execution_count=None, outputs=[])
                else:
                    placed.add(i)
                    cell.update(source=executed[i]["source"], execution_count=executed[i]["execution_count"],
                                outputs=executed[i]["outputs"])
            cells.append(cell)
        cells += [{"cell_type": "code", "id": f"run-{i}", "metadata": {}, "source": executed[i]["source"],
                   "execution_count": executed[i]["execution_count"], "outputs": executed[i]["outputs"]}
                  for i in finals if i not in placed]
        metadata = dict(template.get("metadata") or {})
        metadata.pop("papermill", None)
        metadata["macroarch"] = {"interactive": True, "source": os.environ.get("JPY_SESSION_NAME"),
                                 "start_time": self.started, "end_time": _now(),
                                 "exception": executed[-1]["error"] if executed else None}
        return {"cells": cells, "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}

    def write(self) -> None:
        if not self.targets:
            return
        text = json.dumps(self.notebook(), indent=1, ensure_ascii=False, default=str) + "\n"
        for path in self.targets:
            tmp = path.with_name(f".{path.name}.interactive.partial")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, path)
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise

    def _stop(self, error: BaseException) -> None:
        self.off = True
        warnings.warn(f"macroarch: the executed notebook of this interactive run is not recorded "
                      f"({type(error).__name__}: {error})", RuntimeWarning, stacklevel=2)


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _template() -> dict:
    """The notebook the kernel was opened on, as JSON, or an empty one."""
    path = os.environ.get("JPY_SESSION_NAME")
    with contextlib.suppress(OSError, ValueError, TypeError):
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
        if isinstance(nb, dict) and isinstance(nb.get("cells"), list):
            return nb
    return {"cells": [], "metadata": {"language_info": {"name": "python"}}}


def recorder() -> _Recorder | None:
    """This kernel's recorder, started on first use in an interactive kernel; None elsewhere."""
    global _RECORDER
    if _RECORDER is None:
        shell = _shell()
        if shell is None:
            return None
        try:
            _RECORDER = _Recorder(shell)
        except Exception as e:  # noqa: BLE001 - an ipykernel without these hooks: no recording, one warning
            warnings.warn(f"macroarch: this kernel cannot record its executed notebook ({e})", RuntimeWarning,
                          stacklevel=2)
            return None
    return None if _RECORDER.off else _RECORDER


__all__ = ["recorder"]
