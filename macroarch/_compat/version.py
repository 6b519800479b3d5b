"""The torch releases the shims were written against, and the error a shim raises when a private name has moved."""

from __future__ import annotations

import functools
import re
import warnings

OLDEST = (2, 13)  #: the oldest torch release supported (pyproject.toml: torch>=2.13)
FIRST_UNTESTED = (2, 15)  #: the first release past the range (pyproject.toml: torch<2.15)


def torch_release() -> tuple[int, int]:
    """``(major, minor)`` of the torch that is imported: ``"2.14.1+cu130"`` -> ``(2, 14)``, ``"2.15.0a0+git..."``
    -> ``(2, 15)``."""
    import torch

    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match is None:
        raise RuntimeError(f"cannot read the release from torch.__version__ = {torch.__version__!r}")
    return int(match.group(1)), int(match.group(2))


def tested() -> bool:
    """Whether the imported torch is one of the releases the shims were written against."""
    return OLDEST <= torch_release() < FIRST_UNTESTED


def supported_range() -> str:
    return f"torch>={OLDEST[0]}.{OLDEST[1]},<{FIRST_UNTESTED[0]}.{FIRST_UNTESTED[1]}"


def missing(name: str, purpose: str, error: BaseException | None = None) -> RuntimeError:
    """The error for a private torch name that this torch lacks: which name, what macroarch needs it for, the release
    running and the range the shims know."""
    import torch

    cause = f" ({type(error).__name__}: {error})" if error is not None else ""
    if tested():
        advice = f"torch {torch.__version__} is within the range macroarch supports ({supported_range()}): report it"
    else:
        advice = f"torch {torch.__version__} is outside the range macroarch supports: pip install '{supported_range()}'"
    return RuntimeError(f"{purpose} needs {name}, which torch {torch.__version__} does not provide{cause}; {advice}")


@functools.cache
def check(purpose: str) -> bool:
    """Whether the imported torch is a tested release; if not, warn once per ``purpose`` that the private names it
    uses may have moved (the shim still tries them, and raises ``missing``'s error if they have)."""
    if tested():
        return True
    import torch

    warnings.warn(f"{purpose} uses private torch APIs written against {supported_range()}; torch {torch.__version__} "
                  "is outside that range, so they may have changed", RuntimeWarning, stacklevel=3)
    return False
