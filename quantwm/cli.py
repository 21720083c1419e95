"""Command line: `python -m quantwm {analyze,memory,plan,eval,trace,record,figures,frontier,synth-trace,query-stats,
methods,selfcheck,app} ...` (also installed as `quantwm`).

Long work shows a progress bar on stderr. Bad arguments or files print one line on stderr and exit 2.
`quantwm selfcheck` exits 1 when a kernel fails its check against its reference, naming it on stderr.
`quantwm app ...` starts the diagnostics app (the same as `python app.py ...`).

This module is the entry point (`main`) with the small commands; the others live beside it, a group a module:
`cli_trace.py` (analyze, synth-trace, query-stats, trace), `cli_memory.py` (memory, plan), `cli_eval.py` (eval),
`cli_record.py` (record), `cli_figures.py` (figures, frontier). Their flags are in `cli_parser.py`, the flags'
values in `cli_values.py`, what they print in `cli_output.py`.
"""
from __future__ import annotations

import json
import sys

from .cli_eval import cmd_eval
from .cli_figures import cmd_figures, cmd_frontier
from .cli_memory import cmd_memory, cmd_plan
from .cli_output import table
from .cli_parser import build_parser
from .cli_parser import fail as _fail
from .cli_record import cmd_record
from .cli_trace import cmd_analyze, cmd_query_stats, cmd_synth, cmd_trace
from .cli_values import int_list
from .core.methods import method_sources


def cmd_methods(a) -> int:
    print(table([["method", "bits", "source"], *map(list, method_sources())]))
    print("every quantizing method also runs as <method>+jensen (docs/method.md §3)")
    return 0


def cmd_selfcheck(a) -> int:
    """The kernel report (quantwm/evaluation/kernel_report.py); exit 1 when a kernel failed its check against its
    reference, one stderr line per failed check."""
    from .core import selfcheck
    from .evaluation.kernel_report import report

    for name in ("heads", "head_dim", "chunk_tokens"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(a, name)}")
    out = report(a.model, a.heads, a.head_dim, a.chunk_tokens, int_list(a.lengths, "--lengths") if a.lengths else None,
                 a.method, a.budget)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    failed = selfcheck.fallbacks()
    for v in failed:
        print(f"quantwm: kernel self-check failed: {v.line()}", file=sys.stderr)
    return 1 if failed else 0


def cmd_app(argv: list[str]) -> int:
    try:
        from .app.main import main as app_main
    except ImportError as e:
        return _fail(f"the app cannot start: {e}")
    app_main(argv)
    return 0



COMMANDS = {"analyze": cmd_analyze, "memory": cmd_memory, "plan": cmd_plan, "synth-trace": cmd_synth, "eval": cmd_eval,
            "trace": cmd_trace, "record": cmd_record, "figures": cmd_figures, "frontier": cmd_frontier,
            "query-stats": cmd_query_stats, "methods": cmd_methods, "selfcheck": cmd_selfcheck}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["app"]:
        return cmd_app(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


if __name__ == "__main__":
    sys.exit(main())
