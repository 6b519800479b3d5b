"""``python -m macroarch.planner MODEL --batch N ...``: ``macroarch plan`` without the package CLI."""

import sys

from macroarch.planner.cli import run

sys.exit(run())
