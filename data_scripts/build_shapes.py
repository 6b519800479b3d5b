"""Build a rendered-shapes image-caption dataset into data/shapes/<name>/ (uint8 images, caption tokens, scenes,
meta.json with sha256 hashes); seeded, in seconds. Used by the small CLIP of notebook 11 (claim C15).

    .venv/bin/python data_scripts/build_shapes.py                          # 20,000 training scenes, seed 0
    .venv/bin/python data_scripts/build_shapes.py --n-train 2000 --name shapes_small

The work is done by ``macroarch.data.build_shapes``; this script only parses arguments and reports.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from macroarch.data import ShapesSpec, build_shapes, load_shapes
from macroarch.data.shapes import shapes_root


def main(argv: list[str] | None = None) -> int:
    defaults = ShapesSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=None, help="folder name (default: shapes_n<N>_s<seed>, as notebook 11 uses)")
    parser.add_argument("--root", type=Path, help=f"where datasets live (default: {shapes_root()}; "
                                                  "MACROARCH_DATA=DIR makes it DIR/shapes)")
    for field in ("n_train", "n_val", "n_heldout", "image_size", "max_objects", "seed", "supersample",
                  "context_length"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field),
                            help="(default: %(default)s)")
    args = parser.parse_args(argv)
    spec = {k: getattr(args, k) for k in ("n_train", "n_val", "n_heldout", "image_size", "max_objects", "seed",
                                          "supersample", "context_length")}
    name = args.name or f"shapes_n{args.n_train}_s{args.seed}"
    started = time.perf_counter()
    try:
        path = build_shapes(name, args.root, **spec)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    data = load_shapes(path)
    counts = ", ".join(f"{s} {len(data.split(s))} ({data.meta['splits'][s]['distinct']} distinct scenes)"
                       for s in data.splits)
    print(f"{path}: {counts}; vocabulary {data.vocab_size} words; held-out pairs "
          f"{', '.join(' '.join(p) for p in data.meta['params']['held_out'])}; built in {seconds:.1f} s")
    print(f"dataset_hash {data.dataset_hash}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
