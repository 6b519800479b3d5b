"""macroarch: the post's "macro-architecture" built as PyTorch components, and every claim measured.

Subpackages: ``memory`` (byte accounting), ``models`` (named model builders); ``claims``, ``tracking``,
``runner`` and ``paper`` turn notebooks into results and results into the report.
"""

__version__ = "0.1.0"
