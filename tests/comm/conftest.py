"""tests/comm: ``dist_checks`` (the functions launched ranks run) importable here and in the launched ranks."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))  # last: ``import conftest`` elsewhere must still find tests/conftest.py
