"""The ``macroarch`` command: ``reproduce | paper | claims | runs | memory | config check``.

Exit status: 0 done; 1 a notebook failed, or a file could not be written (the line names it); 2 bad input (an
unknown profile, claim id, notebook, parameter name or type, malformed YAML or result file), with one line on
stderr and nothing written, except that ``paper`` still builds the other claims and shows a malformed result's
claim as unreadable (one line per such file); 75 the profile is being reproduced by another process (the line
names it); 130 interrupted by Ctrl-C, 143 by SIGTERM (128 + the signal; the same one line, the same marks),
resumable by running the same command again.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from macroarch._table import format_table
from macroarch.config import ConfigError
from macroarch.paths import PROFILES

EXIT_FAILED, EXIT_USAGE, EXIT_BUSY, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 75, 130, 143


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from macroarch.repro import paper, runner

    outcomes = runner.reproduce(args.profile, only=args.only, force=args.force, jobs=args.jobs,
                                seed_offset=args.seed_offset)
    if not args.no_paper:
        if args.seed_offset:  # a paper of its own, beside its results: the profile's paper stays offset 0's
            out = runner.results_root(args.seed_offset)
            records = paper.from_results(args.profile, out, unreadable=True)
            with runner.ProfileLock(args.profile, out), _warnings_to_stderr():
                where = paper.build(args.profile, records=records, paper_dir=out / args.profile / "paper")
        else:
            records = paper.collect(args.profile, unreadable=True)
            with runner.ProfileLock(args.profile), _warnings_to_stderr():
                where = paper.build(args.profile, records=records)
        _warn_unreadable(records)
        print(f"paper of profile {args.profile} written to {_shown(where)}/ (claims.md, reproduction.md, figures/, "
              f"evidence/)")
    return EXIT_FAILED if any(o.status in ("failed", "interrupted") for o in outcomes) else 0


def _cmd_paper(args: argparse.Namespace) -> int:
    from macroarch.repro import paper, runner

    records = paper.collect(args.profile, args.source, unreadable=True)  # all read before the paper is touched
    with runner.ProfileLock(args.profile), _warnings_to_stderr():
        where = paper.build(args.profile, source=args.source, records=records, pdf=not args.no_pdf)
    states = ", ".join(f"{n} {s}" for s in paper.STATES if (n := sum(r.state == s for r in records.values())))
    print(f"paper of profile {args.profile} written to {_shown(where)}/ from {args.source}: "
          f"{len(records)} claim(s) updated ({states or 'none'})")
    return EXIT_USAGE if _warn_unreadable(records) else 0


def _warn_unreadable(records) -> bool:
    """One line on stderr per claim whose result file is not a result (its row says unreadable); whether any."""
    from macroarch.repro.paper import UNREADABLE

    bad = [r for r in records.values() if r.state == UNREADABLE]
    for r in bad:
        print(f"macroarch: error: {r.error} (its claim is shown as unreadable)", file=sys.stderr)
    return bool(bad)


class _warnings_to_stderr:
    """The paper's warnings (evidence not copied) as ``macroarch: warning: ...`` lines, not Python's format."""

    def __enter__(self):
        import warnings

        from macroarch.repro.paper import EvidenceWarning

        self._catch = warnings.catch_warnings(record=True)
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always", EvidenceWarning)
        return self

    def __exit__(self, *exc) -> None:
        self._catch.__exit__(*exc)
        for w in self._caught:
            print(f"macroarch: warning: {w.message}", file=sys.stderr)


def _shown(path) -> str:
    try:
        return str(path.relative_to(os.getcwd()))
    except ValueError:
        return str(path)


def claims_markdown() -> str:
    """The registry as the Markdown table of docs/claims.md (a test holds the two equal)."""
    from macroarch.repro.claims import CLAIMS

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| id | section | statement | target | graded by | notebook |", "|---|---|---|---|---|---|"]
    for cid, c in CLAIMS.items():
        lines.append(f"| {cid} | {c.section} | {cell(c.statement)} | {cell(c.target_text)} | {cell(c.grading_text)} "
                     f"| `{c.notebook}` |")
    lines += ["", "How each target is graded (fixed before any run grades it): the target region, the no-effect "
              "band with its reason, the direction, the confidence the interval must have, and what a bare "
              "number under the metric is taken for:", "",
              "| id | metric | direction | target region | no-effect band | confidence | a bare number is | "
              "why the band |", "|---|---|---|---|---|---|---|---|"]
    for cid, c in CLAIMS.items():
        lines += [f"| {cid} | `{t.metric}` | {t.direction} | {cell(t.region_text())} | {t.band_text()} | "
                  f"{t.confidence:.0%} | {cell(t.bare_number_text())} | {cell(t.reason)} |" for t in c.targets]
    lines += ["", "What counts as measuring each claim:", "", "| id | measured by |", "|---|---|"]
    lines += [f"| {cid} | {cell(c.measures)} |" for cid, c in CLAIMS.items()]
    return "\n".join(lines) + "\n"


def _cmd_claims(args: argparse.Namespace) -> int:
    from macroarch.paths import project_root
    from macroarch.repro import paper
    from macroarch.repro.claims import CLAIMS
    from macroarch.repro.tracking import read_result, result_path

    if args.markdown:
        print(claims_markdown(), end="")
        return 0

    latest: dict[str, dict[str, str]] = {p: {} for p in PROFILES}
    for profile in PROFILES:
        try:  # the paper's rows first; a result file, where there is one, is newer
            records = paper.load_records(paper.paper_folder(profile))
        except ValueError as e:
            print(f"macroarch: warning: {e}", file=sys.stderr)
            records = {}
        for cid, rec in records.items():
            latest[profile][cid] = (rec.verdict or {}).get("grade", rec.state)
        for cid in CLAIMS:
            path = result_path(cid, profile)
            try:
                r = read_result(path)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                print(f"macroarch: warning: {e}", file=sys.stderr)
                latest[profile][cid] = "unreadable"
                continue
            latest[profile][cid] = paper._verdict_text(paper.record_from_result(r, path)).replace("**", "") \
                .split(":")[0]

    rows = [("id", "sect.", "notebook", *PROFILES, "target")]
    for cid, c in CLAIMS.items():
        exists = (project_root() / "notebooks" / f"{c.notebook}.ipynb").is_file()
        rows.append((cid, c.section, c.notebook + ("" if exists else " (planned)"),
                     *(latest[p].get(cid, "-") for p in PROFILES), c.target_text))
    print(format_table(rows))
    print("\ncolumns ci, cpu, gpu: the latest verdict per profile (result files, else the profile's paper); "
          "statements and grading rules: docs/claims.md")
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    import warnings

    from macroarch.paths import out_root, wandb_root
    from macroarch.repro.claims import CLAIMS
    from macroarch.repro.tracking import read_result, result_path
    from macroarch.repro.wandb_offline import OfflineRunWarning, find_offline_runs

    rows = [("claim", "profile", "status", "verdict", "finished", "wandb")]
    for profile in PROFILES:
        if args.profile and profile != args.profile:
            continue
        for cid in CLAIMS:
            path = result_path(cid, profile, out_root())
            try:
                r = read_result(path)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                print(f"macroarch: warning: {e}", file=sys.stderr)
                rows.append((cid, profile, "unreadable", "-", "-", "-"))
                continue
            w = r.get("wandb") or {}
            wtext = f"{w.get('mode') or '-'} {w.get('id') or ''}".strip() + (" (W&B error)" if w.get("error") else "")
            rows.append((cid, profile, r.get("status", "?"), (r.get("verdict") or {}).get("grade", "-"),
                         r.get("finished") or "-", wtext))
    print(f"results in {out_root()}:")
    print(format_table(rows) if len(rows) > 1 else "  (none)")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", OfflineRunWarning)
        try:
            runs = find_offline_runs(wandb_root())
        except FileNotFoundError:
            runs = []
    for w in caught:
        print(f"macroarch: warning: {w.message}", file=sys.stderr)
    wrows = [("run", "claim", "profile", "status", "verdict", "exit", "started", "directory")]
    for run in runs:
        if args.profile and run.config.get("profile") != args.profile:
            continue
        verdict = run.summary.get("verdict")
        wrows.append((run.run_id, run.config.get("claim", "-"), run.config.get("profile", "-"),
                      run.summary.get("status", "-"), verdict.get("grade", "-") if isinstance(verdict, dict) else "-",
                      "-" if run.exit_code is None else str(run.exit_code),
                      run.started.isoformat(timespec="seconds") if run.started else "-", run.directory.name))
    print(f"\nW&B offline runs in {wandb_root() / 'wandb'} (look: `wandb leet <directory>`; upload: "
          f"`wandb sync <directory>`):")
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


def _cmd_config_check(args: argparse.Namespace) -> int:
    """``macroarch config check FILE``: load a technique config (``macroarch.config``); apply nothing."""
    from macroarch.config import load_config

    c = load_config(args.file)  # a bad key or value: ConfigError naming it, one line and exit 2 in main()
    parts = [f"MVAS {dict(c.mvas.precision_policy or {}) or c.mvas.target_reduction}" if c.uses_mvas else "no MVAS",
             f"DGR groups of {c.dgr.group_size}" if c.uses_dgr else "no DGR", f"lr {c.optim.lr:g}"]
    print(f"{args.file}: ok ({'; '.join(parts)})")
    return 0


#: macroarch.measure.memory.PRECISIONS by name (the parser is built without importing torch; a test holds them equal)
MEMORY_PRECISIONS = ("fp32", "fp16", "post", "bf16_mixed", "mixed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macroarch", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("reproduce", help="run a profile's notebooks with papermill, then update its paper")
    r.add_argument("--profile", default="cpu", help=f"one of {', '.join(PROFILES)} (default: cpu)")
    r.add_argument("--only", metavar="IDS", help="comma-separated claim ids, e.g. C4,C7")
    r.add_argument("--force", action="store_true", help="re-run notebooks whose results are up to date")
    r.add_argument("--no-paper", action="store_true", help="do not update the paper afterwards")
    r.add_argument("--jobs", type=int, metavar="N",
                   help="notebooks run at once, each pinned to cores of its own (its 'threads'; the ones the profile "
                        "marks exclusive run alone on all cores); default: as many as fit on the cores this process "
                        "may use")
    r.add_argument("--seed-offset", type=int, default=0, metavar="K",
                   help="add K (0 or more) to every notebook's 'seed' parameter, for a second, independent run; "
                        "results and their paper go to papermill_runs/out/seed<K>/<profile>/ (the profile's own "
                        "paper stays built from offset 0); default 0")
    r.set_defaults(fn=_cmd_reproduce)

    pp = sub.add_parser("paper", help="merge a profile's latest runs into its paper (cpu: paper/; others: "
                                      "papermill_runs/out/<profile>/paper/)")
    pp.add_argument("--profile", default="cpu", help="the profile whose paper to build: ci, cpu (paper/) or gpu")
    pp.add_argument("--no-pdf", action="store_true", help="write reproduction.md only, not reproduction.pdf")
    pp.add_argument("--source", default="results", help="results (result.json files) or wandb (offline runs)")
    pp.set_defaults(fn=_cmd_paper)

    from macroarch.planner.cli import add_parser as add_plan_parser

    add_plan_parser(sub)

    c = sub.add_parser("claims", help="the claims registry with the latest verdict per profile")
    c.add_argument("--markdown", action="store_true", help="the registry as the Markdown table of docs/claims.md")
    c.set_defaults(fn=_cmd_claims)

    ru = sub.add_parser("runs", help="list result files and W&B offline runs")
    ru.add_argument("--profile", default=None, help=f"only this profile's runs, one of {', '.join(PROFILES)} "
                                                    "(default: every profile)")
    ru.set_defaults(fn=_cmd_runs)

    m = sub.add_parser("memory", help="analytic training-state bytes of a named model")
    m.add_argument("model", help="a model spec name, e.g. gpt3_175b, llama_65b")
    m.add_argument("--precision", default="bf16_mixed", choices=MEMORY_PRECISIONS,
                   help="the training-state accounting: fp32, fp16, post (the post's 8 B/param), bf16_mixed "
                        "(16 B/param: bf16 weights and gradients, fp32 master and Adam moments) or mixed; default "
                        "bf16_mixed")
    m.set_defaults(fn=_cmd_memory)

    cf = sub.add_parser("config", help="technique configs (YAML such as configs/clip_post.yaml)")
    ck = cf.add_subparsers(dest="action", required=True).add_parser(
        "check", help="load a config and report it; a bad key or value is one line on stderr and exit 2")
    ck.add_argument("file", help="a YAML config, e.g. configs/clip_post.yaml")
    ck.set_defaults(fn=_cmd_config_check)
    return p


def _check_locations() -> None:
    from macroarch.paths import out_root

    for var in ("MACROARCH_OUT", "WANDB_DIR"):
        if (value := os.environ.get(var)) and os.path.exists(value) and not os.path.isdir(value):
            raise ConfigError(f"{var}={value} is a file; it must name a folder")
    out = out_root()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output folder {out} is a file")


def main(argv: Sequence[str] | None = None) -> int:
    from macroarch.repro.runner import Interrupted, ProfileBusy, sigterm_as_ctrl_c
    from macroarch.repro.tracking import ResultFileError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "profile", None) is not None:
            from macroarch.paths import check_profile

            check_profile(args.profile)
        _check_locations()
        if args.fn is _cmd_reproduce:  # SIGTERM (kill, a service stopping) takes Ctrl-C's path, paper included
            with sigterm_as_ctrl_c():
                return args.fn(args)
        return args.fn(args)
    except ProfileBusy as e:
        print(f"macroarch: {e}", file=sys.stderr)
        return EXIT_BUSY
    except (ConfigError, ResultFileError) as e:
        print(f"macroarch: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"macroarch: error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return EXIT_FAILED
    except (Interrupted, KeyboardInterrupt) as e:
        import signal

        terminated = getattr(e, "signum", signal.SIGINT) == signal.SIGTERM
        what = f" ({e})" if str(e) else ""
        print(f"\nmacroarch: interrupted{' by SIGTERM' if terminated else ''}{what}; run the same command again to "
              f"resume", file=sys.stderr)
        if argv is None:  # the console script: nothing of the kernels' shutdown may reach the terminal now
            sys.stderr.flush()
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (kept open until the interpreter exits)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


if __name__ == "__main__":
    sys.exit(main())
