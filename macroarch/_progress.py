"""Progress as users see it: a widget bar in JupyterLab, clean text elsewhere; and a notice for a long wait.

- :func:`tqdm`: ``tqdm.notebook.tqdm`` (an ipywidgets bar) in an interactive IPython kernel where ipywidgets is
  installed; ``tqdm.std.tqdm`` (text on stderr) in a terminal, a script, and in the kernels ``macroarch reproduce``
  starts (their executed notebooks are evidence read as files, where a widget is a placeholder without its state).
  Every call takes tqdm's own arguments; ``mininterval`` defaults to 10 s, the harnesses' setting for loops whose
  steps take milliseconds to seconds.
- :class:`SlowNotice`: a context manager that says ``what`` is happening when it has lasted ``after`` seconds, and
  how long it took once it is done; a wait that ends sooner prints nothing (a warm cache is silent).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

#: set by the runner in the kernels it starts (``macroarch.repro.tracking.EVIDENCE_ENV``): a batch run
BATCH_ENV = "MACROARCH_EVIDENCE"


def widgets_available() -> bool:
    """Whether progress can be a widget here: an IPython kernel (not a terminal IPython), ipywidgets importable,
    and not a kernel of ``macroarch reproduce``."""
    if os.environ.get(BATCH_ENV):
        return False
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
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
    """``with SlowNotice("compiling the adamw_step kernel", after=5):`` prints ``what`` (on stderr, flushed) once the
    block has run ``after`` seconds, and ``... done in N s`` when it ends; nothing for a block that ends sooner.
    ``detail`` follows ``what`` in the first line (why it is slow, whether it will be again)."""

    def __init__(self, what: str, *, after: float = 5.0, detail: str = "", prefix: str = "macroarch") -> None:
        self.what, self.after, self.detail, self.prefix = what, after, detail, prefix
        self.said = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._start = 0.0

    def _say(self) -> None:
        with self._lock:
            if self._timer is None:  # ended meanwhile
                return
            self.said = True
            tail = f" ({self.detail})" if self.detail else ""
            print(f"{self.prefix}: {self.what}{tail} ...", file=sys.stderr, flush=True)

    def __enter__(self) -> SlowNotice:
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
            print(f"{self.prefix}: {self.what}: done in {seconds:.0f} s", file=sys.stderr, flush=True)
