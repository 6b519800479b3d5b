"""Build a byte-level text corpus into data/text/<name>/ (train.bin, val.bin, meta.json with sha256 hashes).

    .venv/bin/python data_scripts/build_text_corpus.py                       # the Python standard library
    .venv/bin/python data_scripts/build_text_corpus.py --source ~/notes --name notes --max-bytes 50000000

The work is done by ``macroarch.data.build_corpus``; this script only parses arguments and reports.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from macroarch.data import DEFAULT_MAX_BYTES, build_corpus, load_corpus, text_root
from macroarch.data.text import DEFAULT_PATTERNS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", nargs="+", metavar="DIR", default=[],
                        help="folders of your own text files (default: the Python standard library's .py files)")
    parser.add_argument("--name", help="corpus folder name (default: 'stdlib', or the first --source folder's name)")
    parser.add_argument("--root", type=Path, help=f"where corpora live (default: {text_root()}; "
                                                  "MACROARCH_DATA=DIR makes it DIR/text)")
    parser.add_argument("--pattern", nargs="+", metavar="GLOB",
                        help=f"file-name patterns for --source (default: {' '.join(DEFAULT_PATTERNS)})")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help="cap on train + val bytes (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of files for val (default: %(default)s)")
    args = parser.parse_args(argv)

    name = args.name or (Path(args.source[0]).resolve().name if args.source else "stdlib")
    started = time.perf_counter()
    try:
        path = build_corpus(name, args.root, sources=args.source, patterns=args.pattern, max_bytes=args.max_bytes,
                            val_fraction=args.val_fraction)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    meta = load_corpus(path).meta
    splits = meta["splits"]
    print(f"{path}: {meta['source']['kind']} ({meta['source']['python']}), {meta['n_files']} of "
          f"{meta['n_files_found']} files, train {splits['train']['bytes']:,} bytes ({splits['train']['n_files']} "
          f"files), val {splits['val']['bytes']:,} bytes ({splits['val']['n_files']} files), "
          f"{sum(s['count'] for s in meta['skipped'].values())} skipped, built in {seconds:.1f} s")
    print(f"corpus_hash {meta['corpus_hash']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
