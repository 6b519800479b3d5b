"""What the runner shows while notebooks run: for each, code cells done / total and the time elapsed, one line.

A papermill engine (``NBClientEngine`` with its ``cell_complete`` wrapped) reports each finished code cell;
:class:`Board` shows one line per running notebook, ``[1/8] 01_gradient_explosion (C2, C3, R1)  cell 12/31,
1m05s, core 0``, rewritten in place on a terminal every second, and on anything else (a log file, a pipe)
printed every few minutes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from macroarch.repro.profiles import format_duration

Progress = Callable[[int, int, float], None]  # (code cells done, code cells in all, seconds elapsed)

_ENGINE = "macroarch-progress"
_progress_callback: Progress | None = None


def engine(progress: Progress | None) -> str:
    """A papermill engine that reports code cells done to ``progress`` (registered once)."""
    global _progress_callback
    from papermill.engines import NBClientEngine, papermill_engines

    _progress_callback = progress
    if _ENGINE not in papermill_engines._engines:

        class _ProgressEngine(NBClientEngine):
            @classmethod
            def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
                total = sum(c.cell_type == "code" for c in nb_man.nb.cells)
                t0 = time.perf_counter()
                done = [0]
                complete = nb_man.cell_complete

                def cell_complete(cell, cell_index=None, **kw):
                    complete(cell, cell_index=cell_index, **kw)
                    if cell.cell_type == "code":
                        done[0] += 1
                    if _progress_callback is not None:
                        _progress_callback(done[0], total, time.perf_counter() - t0)

                nb_man.cell_complete = cell_complete
                if _progress_callback is not None:
                    _progress_callback(0, total, 0.0)
                return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

        papermill_engines.register(_ENGINE, _ProgressEngine)
    return _ENGINE


class Board:
    """One line per running notebook, ``[1/8] 01_gradient_explosion (C2, C3, R1)  cell 12/31, 1m05s, core 0``:
    rewritten in place on a terminal every second (cut to the terminal's width, so that the cursor can go back
    over them); on anything else (a log file, a pipe) each printed every few minutes.

    :meth:`print` writes a line of its own (a notebook's outcome) above the running ones. Thread-safe: the
    runner updates it from the threads that read its workers."""

    def __init__(self, stream: Any, echo: Callable[..., Any] = print, every_s: float = 300.0) -> None:
        self.stream, self.echo = stream, echo
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every_s = every_s
        self._rows: dict[str, _Row] = {}  # key -> row, in the order they started
        self._drawn = 0  # lines on the terminal now
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def __enter__(self) -> Board:
        self._thread.start()
        return self

    def add(self, key: str, head: str, where: str = "") -> None:
        with self._lock:
            self._rows[key] = _Row(head, where)
            self._redraw()

    def update(self, key: str, done: int, total: int) -> None:
        with self._lock:
            if key in self._rows:
                self._rows[key].cells = (done, total)
                self._redraw()

    def remove(self, key: str) -> None:
        with self._lock:
            self._rows.pop(key, None)
            self._redraw()

    def print(self, text: str) -> None:
        """``text`` on a line of its own, the running notebooks' lines below it."""
        with self._lock:
            self._erase()
            self.echo(text, flush=True)
            self._redraw()

    def texts(self) -> list[str]:
        with self._lock:
            return [row.text() for row in self._rows.values()]

    def _redraw(self) -> None:
        if not self.tty:
            return
        import shutil

        width = max(20, shutil.get_terminal_size().columns - 1)
        lines = [t[:width] for t in self.texts()]
        with contextlib.suppress(Exception):
            self.stream.write(self._erase_text() + "\n".join(lines))
            self.stream.flush()
        self._drawn = len(lines)

    def _erase(self) -> None:
        if self.tty and self._drawn:
            with contextlib.suppress(Exception):
                self.stream.write(self._erase_text())
                self.stream.flush()
            self._drawn = 0

    def _erase_text(self) -> str:
        return "\r\x1b[2K" + "\x1b[1A\x1b[2K" * max(0, self._drawn - 1)

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(1.0):
            with self._lock:
                if self.tty:
                    self._redraw()
                elif time.perf_counter() - last >= self.every_s:
                    last = time.perf_counter()
                    with contextlib.suppress(Exception):
                        self.stream.write("".join(f"  ... {t}\n" for t in self.texts()))
                        self.stream.flush()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._erase()


class _Row:
    def __init__(self, head: str, where: str) -> None:
        self.head, self.where = head, where
        self.cells = (0, 0)
        self.t0 = time.perf_counter()

    def text(self) -> str:
        done, total = self.cells
        cells = f"cell {min(done + 1, total)}/{total}" if total else "starting"
        where = f", {self.where}" if self.where else ""
        return f"{self.head}  {cells}, {format_duration(time.perf_counter() - self.t0)}{where}"
