"""``macroarch plan MODEL --batch N --seq N [--frames N | --points N] [--gpu KEY | --budget GB] [--devices N]
[--with ...] [--policy FILE] [--dtype RECIPE] [--json] [--plot FILE]``: ``add_parser`` registers it on a CLI's
subparsers, ``main`` runs it.

Bad input (an unknown model, technique, card or dtype, a config that is not JSON, a budget of zero or infinity, a
plot in a folder that does not exist, an argument argparse refuses) is one line on stderr and exit status 2, before
anything is planned; otherwise the plan is printed (``--json``: one object) and the status is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

TECHNIQUES = ("mvas", "master", "dgr", "checkpoint", "fsdp2")  # macroarch.planner.run.TECHNIQUES, without torch
SEARCHES = ("batch", "seq", "frames", "points")  # macroarch.planner.core.SEARCHES, without torch


def _one_line_error(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` report a bad argument as one line on stderr, exit status 2 (argparse prints the usage too),
    unrecognised ones included (a subcommand's parser would pass those up to the CLI's own parser)."""
    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {' '.join(message.split())}\n")

    parse_known_args = parser.parse_known_args

    def strict(args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
               ) -> tuple[argparse.Namespace, list[str]]:
        known, extras = parse_known_args(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return known, extras

    parser.error = error
    parser.parse_known_args = strict


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``plan`` subcommand on ``subparsers``, its handler set as ``fn`` (``args.fn(args)`` returns the status)."""
    p = subparsers.add_parser(
        "plan", help="will a model's training step fit, and with which techniques (fake tensors, on a CPU)",
        description="One training step per combination of techniques under fake tensors: bytes per device by "
                    "category, the peak, whether it fits, the largest batch that fits, the cheapest combination.")
    p.add_argument("model", help="config.json (or its directory), a project builder, an open_clip or timm name, "
                                 "or module:fn")
    p.add_argument("--batch", type=int, default=1, help="samples per device per step (default 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sample, or a vision model's image side")
    p.add_argument("--frames", type=int, default=None, help="a video model's clip length (default: its config's)")
    p.add_argument("--points", type=int, default=None, help="a point-cloud model's points per cloud (default: 1024)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--gpu", help="a card of the accelerator table: key or name (a100, h100, 'A100 SXM4 80GB')")
    budget.add_argument("--budget", type=float, help="bytes per device, in GB (1e9)")
    p.add_argument("--devices", type=int, default=1, help="device count (fsdp2 shards over it)")
    p.add_argument("--with", dest="techniques", default="",
                   help=f"comma-separated techniques to combine: {','.join(TECHNIQUES)}")
    p.add_argument("--policy", help="technique config YAML (MVAS precision policy, DGR group size), e.g. "
                                    "configs/clip_post.yaml")
    p.add_argument("--dtype", default="bf16_mixed", help="dtype recipe: fp32, bf16_mixed, post, fp16, mixed")
    p.add_argument("--group-size", type=int, default=None, help="DGR blocks per group (default: the policy's, else 1)")
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"), help="transformers attention kernels")
    p.add_argument("--search", default="batch", choices=SEARCHES,
                   help="what the largest fitting size varies: batch, seq (tokens), frames (video), points")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE", help="write a bar chart (PNG)")
    p.set_defaults(fn=main)
    _one_line_error(p)
    return p


def _check_plot(path: str) -> None:
    from macroarch.planner.models import PlanError

    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise PlanError(f"--plot {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PlanError(f"--plot {path}: folder {folder} is not writable")


def main(args: argparse.Namespace) -> int:
    """Run the ``plan`` subcommand on parsed ``args``; returns the exit status (2 for bad input)."""
    from macroarch.planner.core import PlanError, plan
    from macroarch.planner.report import plot

    try:
        if args.plot:
            _check_plot(args.plot)
        result = plan(args.model, args.batch, args.seq, frames=args.frames, points=args.points, gpu=args.gpu,
                      budget_gb=args.budget, devices=args.devices, techniques=args.techniques, policy=args.policy,
                      dtype=args.dtype, group_size=args.group_size, attention=args.attention, search=args.search)
    except PlanError as e:
        print(f"macroarch plan: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=1) if args.json else result.text())
    if args.plot:
        try:
            plot(result, args.plot)
        except OSError as e:  # the folder went away or filled up since it was checked
            print(f"macroarch plan: --plot {args.plot}: {e}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    """``python -m macroarch.planner ...``: the same command without the ``macroarch`` CLI around it."""
    parser = argparse.ArgumentParser(prog="macroarch")
    _one_line_error(parser)
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)


__all__ = ["add_parser", "main", "run"]
