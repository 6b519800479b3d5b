"""The element arithmetic of MVAS: what a stored element is, independent of any tensor that holds it.

- ``formats``: the table of formats (``Format``, ``get_format``) and their byte accounting;
- ``codes``: rounding (nearest, stochastic), fp8 and fp4 codes, ``encode`` / ``decode``;
- ``noise``: the counter-based noise of stochastic rounding and the stream keys.
"""
