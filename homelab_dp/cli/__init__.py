"""`homelab-dp`: the headless command line (argparse + rich). Thin: no logic of its own.

`main` (cli/main.py) builds the top parser and dispatches; each command group is a module
with ``register(subparsers)``: probe, plan, measure, presets, runs (run, runs, status,
attach, stop, resume). What they print for people comes from `homelab_dp.render`, shared
with the TUI; ``--json`` prints the documents scripts read.

Exit codes: 0 success; 2 bad input (one ``error:`` line naming the field, file or line, and a
``hint:`` line); 1 the run failed; 130 interrupted.
"""

from homelab_dp.cli.main import main

__all__ = ["main"]
