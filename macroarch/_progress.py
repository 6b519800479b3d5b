"""Progress as users see it: a widget bar in JupyterLab, clean text elsewhere; and a notice for a long wait.

- :func:`tqdm`: ``tqdm.notebook.tqdm`` (an ipywidgets bar) in an interactive IPython kernel where ipywidgets is
  installed; ``tqdm.std.tqdm`` (text on stderr) in a terminal, a script, and in the kernels ``macroarch reproduce``
  starts (their executed notebooks are evidence read as files, where a widget is a placeholder without its state).
  Every call takes tqdm's own arguments; ``mininterval`` defaults to 10 s, the harnesses' setting for loops whose
  steps take milliseconds to seconds.
- :class:`SlowNotice`: a context manager that says ``what`` is happening when it has lasted ``after`` seconds, and
  how long it took once it is done; a wait that ends sooner prints nothing (a warm cache is silent). In a Jupyter
  kernel the notice is one line of the cell's output (a ``text/plain`` display, updated in place to say how long it
  took), not stderr, which JupyterLab shows as an error-coloured box; elsewhere two lines of plain text on stderr.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

#: set by the runner in the kernels it starts (``macroarch.repro.tracking.EVIDENCE_ENV``): a batch run
BATCH_ENV = "MACROARCH_EVIDENCE"


def in_kernel() -> bool:
    """Whether this process is an IPython kernel, whose output a Jupyter front end shows (not a terminal IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def widgets_available() -> bool:
    """Whether progress can be a widget here: an IPython kernel (not a terminal IPython), ipywidgets importable,
    and not a kernel of ``macroarch reproduce``."""
    if os.environ.get(BATCH_ENV) or not in_kernel():
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def tqdm(*args: Any, **kwargs: Any) -> Any:
    """A progress bar (module docstring): a widget in JupyterLab, text elsewhere."""
    kwargs.setdefault("mininterval", 10)
    if widgets_available():
        from tqdm.notebook import tqdm as bar
    else:
        from tqdm.std import tqdm as bar
    return bar(*args, **kwargs)


class SlowNotice:
    """``with SlowNotice("compiling the adamw_step kernel", after=5):`` says ``what`` once the block has run ``after``
    seconds, and ``... done in N s`` when it ends; nothing for a block that ends sooner. ``detail`` follows ``what``
    in the first line (why it is slow, whether it will be again). In a Jupyter kernel (:func:`in_kernel`) it is a
    display in the running cell's output, updated in place when done; elsewhere it prints on stderr, flushed."""

    def __init__(self, what: str, *, after: float = 5.0, detail: str = "", prefix: str = "macroarch") -> None:
        self.what, self.after, self.detail, self.prefix = what, after, detail, prefix
        self.said = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._start = 0.0
        self._kernel = False  # set on entering: show the notice as a display
        self._display: Any = None  # IPython's DisplayHandle of the notice, in a kernel

    def _show(self, text: str) -> None:
        """``text`` as the notice: the kernel's display (the first time) or its update, or a line on stderr."""
        if not self._kernel:
            print(text, file=sys.stderr, flush=True)
        elif self._display is None:
            from IPython.display import display

            # from the timer's thread: ipykernel sends it to the cell that is executing (the one waiting here)
            self._display = display({"text/plain": text}, raw=True, display_id=True)
        else:
            self._display.update({"text/plain": text}, raw=True)

    def _say(self) -> None:
        with self._lock:
            if self._timer is None:  # ended meanwhile
                return
            self.said = True
            tail = f" ({self.detail})" if self.detail else ""
            self._show(f"{self.prefix}: {self.what}{tail} ...")

    def __enter__(self) -> SlowNotice:
        self._kernel = in_kernel()
        self._start = time.perf_counter()
        self._timer = threading.Timer(self.after, self._say)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if self.said:
            seconds = time.perf_counter() - self._start
            self._show(f"{self.prefix}: {self.what}: done in {seconds:.0f} s")
