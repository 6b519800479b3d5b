"""The ``macroarch`` command: ``reproduce | paper | claims | runs | memory``.

Bad input (an unknown profile, claim id, notebook, parameter key, malformed YAML) is one line on stderr
and exit status 2, with nothing written; a reproduction in which a notebook failed exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from macroarch.config import ConfigError
from macroarch.paths import PROFILES
from macroarch._table import format_table


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from macroarch.repro import paper, runner

    outcomes = runner.reproduce(args.profile, only=args.only, force=args.force)
    if not args.no_paper:
        where = paper.build(args.profile)
        print(f"paper written to {where}/ (claims.md, reproduction.md, figures/)")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def _cmd_paper(args: argparse.Namespace) -> int:
    from macroarch.repro import paper

    results = paper.collect(args.profile, args.source)
    where = paper.build(args.profile, source=args.source, results=results)
    print(f"paper written to {where}/ from {args.source}: {len(results)} measured claim(s)")
    return 0


def _cmd_claims(args: argparse.Namespace) -> int:
    from macroarch.repro.claims import CLAIMS
    from macroarch.repro.tracking import read_result, result_path

    rows = [("id", "sect.", "notebook", "target", *PROFILES)]
    for cid, c in CLAIMS.items():
        grades = []
        for profile in PROFILES:
            try:
                r = read_result(result_path(cid, profile))
            except (OSError, ValueError):
                grades.append("-")
                continue
            grades.append(r["verdict"]["grade"] if r.get("status") == "complete" and r.get("verdict")
                          else r.get("status", "?"))
        target = c.target_text if len(c.target_text) <= 48 else c.target_text[:45] + "..."
        rows.append((cid, c.section, c.notebook, target, *grades))
    print(format_table(rows))
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    from macroarch.paths import out_root, wandb_root
    from macroarch.repro.claims import CLAIMS
    from macroarch.repro.tracking import read_result, result_path
    from macroarch.repro.wandb_offline import find_offline_runs

    rows = [("claim", "profile", "status", "verdict", "finished", "wandb")]
    for profile in PROFILES:
        if args.profile and profile != args.profile:
            continue
        for cid in CLAIMS:
            try:
                r = read_result(result_path(cid, profile, out_root()))
            except (OSError, ValueError):
                continue
            w = r.get("wandb") or {}
            rows.append((cid, profile, r.get("status", "?"), (r.get("verdict") or {}).get("grade", "-"),
                         r.get("finished") or "-", f"{w.get('mode') or '-'} {w.get('id') or ''}".strip()))
    print(f"results in {out_root()}:")
    print(format_table(rows) if len(rows) > 1 else "  (none)")

    runs = find_offline_runs(wandb_root())
    wrows = [("run", "claim", "profile", "status", "verdict", "exit", "started", "directory")]
    for run in runs:
        if args.profile and run.config.get("profile") != args.profile:
            continue
        verdict = run.summary.get("verdict")
        wrows.append((run.run_id, run.config.get("claim", "-"), run.config.get("profile", "-"),
                      run.summary.get("status", "-"), verdict.get("grade", "-") if isinstance(verdict, dict) else "-",
                      "-" if run.exit_code is None else str(run.exit_code),
                      run.started.isoformat(timespec="seconds") if run.started else "-", run.directory.name))
    print(f"\nW&B offline runs in {wandb_root() / 'wandb'} (upload with `wandb sync <directory>`):")
    print(format_table(wrows) if len(wrows) > 1 else "  (none)")
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    from macroarch.measure.memory import format_bytes, parameter_count, training_state_bytes
    from macroarch.models import get_model_spec

    try:
        spec = get_model_spec(args.model)
        state = training_state_bytes(spec, args.precision)
    except ValueError as e:  # an unknown model or precision: the message names it and lists the known ones
        raise ConfigError(str(e)) from None
    n = parameter_count(spec)
    print(f"{spec.name}: {n:,} parameters; precision {args.precision}")
    for k, v in state.items():
        print(f"  {k:<16} {format_bytes(v)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macroarch", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("reproduce", help="run a profile's notebooks with papermill, then build the paper")
    r.add_argument("--profile", default="cpu", help=f"one of {', '.join(PROFILES)} (default: cpu)")
    r.add_argument("--only", metavar="IDS", help="comma-separated claim ids, e.g. C4,C7")
    r.add_argument("--force", action="store_true", help="re-run notebooks whose results are up to date")
    r.add_argument("--no-paper", action="store_true", help="do not build paper/ afterwards")
    r.set_defaults(fn=_cmd_reproduce)

    pp = sub.add_parser("paper", help="build paper/ from the results of a profile")
    pp.add_argument("--profile", default="cpu")
    pp.add_argument("--source", default="results", help="results (result.json files) or wandb (offline runs)")
    pp.set_defaults(fn=_cmd_paper)

    c = sub.add_parser("claims", help="the claims registry with the latest verdict per profile")
    c.set_defaults(fn=_cmd_claims)

    ru = sub.add_parser("runs", help="list result files and W&B offline runs")
    ru.add_argument("--profile", default=None)
    ru.set_defaults(fn=_cmd_runs)

    m = sub.add_parser("memory", help="analytic training-state bytes of a named model")
    m.add_argument("model", help="a model spec name, e.g. gpt3_175b, llama_65b")
    m.add_argument("--precision", default="bf16_mixed")
    m.set_defaults(fn=_cmd_memory)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "profile", None) is not None:
            from macroarch.paths import check_profile

            check_profile(args.profile)
        return args.fn(args)
    except ConfigError as e:
        print(f"macroarch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
