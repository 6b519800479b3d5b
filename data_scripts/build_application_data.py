"""Build the synthetic datasets of the application notebook (C12-C14) into data/applications/<kind>-<hash>/.

    .venv/bin/python data_scripts/build_application_data.py                   # all three, default settings
    .venv/bin/python data_scripts/build_application_data.py videos --set frames=16 size=64 n=2048

The work is done by ``macroarch.data.applications``; this script only parses arguments and reports.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time

from macroarch.data.applications import SPECS, build_dataset, load_dataset


def _setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: settings are key=value")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a number") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", metavar="KIND", help=f"which datasets: {', '.join(SPECS)} (default: all)")
    parser.add_argument("--set", nargs="+", type=_setting, default=[], metavar="KEY=VALUE",
                        help="spec settings (n, length, points, frames, size, classes, noise, seed...)")
    parser.add_argument("--root", help="where datasets live (default: data/applications; MACROARCH_DATA=DIR "
                                       "makes it DIR/applications)")
    args = parser.parse_args(argv)
    settings = dict(args.set)
    unknown = [k for k in args.kinds if k not in SPECS]
    if unknown:
        print(f"error: unknown dataset kind(s) {unknown}; known: {', '.join(SPECS)}", file=sys.stderr)
        return 2
    kinds = args.kinds or list(SPECS)
    stray = [k for k in settings if not any(k in SPECS[kind].__dataclass_fields__ for kind in kinds)]
    if stray:
        print(f"error: setting(s) {stray} belong to none of {', '.join(kinds)}", file=sys.stderr)
        return 2
    for kind in kinds:
        started = time.perf_counter()
        spec = {k: v for k, v in settings.items() if k in SPECS[kind].__dataclass_fields__}
        try:
            path = build_dataset(kind, args.root, **spec)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        arrays = load_dataset(path)
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in arrays.items())
        print(f"{path}: {shapes}, built in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
