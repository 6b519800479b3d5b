"""What the runner shows while a notebook runs: code cells done / total and the time elapsed, on one line.

A papermill engine (``NBClientEngine`` with its ``cell_complete`` wrapped) reports each finished code cell;
:class:`LiveLine` rewrites ``[1/8] 01_gradient_explosion (C2, C3, R1)  cell 12/31, 1m05s`` in place on a
terminal, every second, and on anything else (a log file, a pipe) prints it every few minutes.
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


class LiveLine:
    """``[1/8] 01_gradient_explosion (C2, C3, R1)  cell 12/31  1m05s`` rewritten in place on a terminal; on
    anything else (a log file, a pipe) a line every few minutes."""

    def __init__(self, head: str, stream: Any, every_s: float = 300.0) -> None:
        self.head, self.stream = head, stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.cells = (0, 0)
        self.t0 = time.perf_counter()
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def __enter__(self) -> LiveLine:
        self._thread.start()
        return self

    def update(self, done: int, total: int, _elapsed: float) -> None:
        self.cells = (done, total)
        if self.tty:
            self._draw()

    def text(self) -> str:
        done, total = self.cells
        cells = f"cell {min(done + 1, total)}/{total}" if total else "starting"
        return f"{self.head}  {cells}, {format_duration(time.perf_counter() - self.t0)}"

    def _draw(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.write("\r\x1b[2K" + self.text())
            self.stream.flush()

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(1.0):
            if self.tty:
                self._draw()
            elif time.perf_counter() - last >= self.every_s:
                last = time.perf_counter()
                with contextlib.suppress(Exception):
                    self.stream.write(f"  ... {self.text()}\n")
                    self.stream.flush()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if self.tty:
            with contextlib.suppress(Exception):
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
