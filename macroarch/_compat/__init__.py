"""Every private torch API macroarch touches, one named shim per concern.

Each shim imports what it needs lazily (never at ``import macroarch``), checks the torch release it was
written against, and falls back or raises an error that names the release when the private name has moved.
``tests/test_private_api.py`` lists every private torch name in the package and fails on one outside
``macroarch/_compat``.
"""
