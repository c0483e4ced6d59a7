"""The console scripts (``mode-train``, ``mode-export``, ``mode-prepare``, ``mode-eval``,
``mode-generate``, ``mode-lm-eval``): each runs its module's ``main`` and prints a user's mistake (a bad option,
a missing or refused file: the errors ``USER_ERRORS`` lists, which name the field and the fix)
as one message on stderr with exit status 2, not a traceback around it. ``MODE_DEBUG=1`` in
the environment shows the traceback. Python callers of each ``main`` get the exception itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

DEBUG_VARIABLE = "MODE_DEBUG"


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that describe bad input rather than a defect: ``ValueError`` (config,
    checkpoint and Hugging Face refusals derive from it), missing files, an occupied run
    directory, a corpus that cannot be fetched."""
    from mode.data import CorpusUnavailable  # noqa: PLC0415  (imports torch: only when a script runs)
    from mode.run_dir import RunDirectoryError  # noqa: PLC0415

    return (ValueError, FileNotFoundError, RunDirectoryError, CorpusUnavailable)


def run(prog: str, main: Callable[[], object]) -> None:
    """``main()``; a ``user_errors`` exception becomes ``prog: message`` on stderr and exit 2
    (unless ``MODE_DEBUG`` is set to something other than 0)."""
    try:
        main()
    except user_errors() as e:
        if os.environ.get(DEBUG_VARIABLE, "0") not in ("", "0"):
            raise
        print(f"{prog}: {e}\n({DEBUG_VARIABLE}=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)


def train() -> None:
    from mode.train import main  # noqa: PLC0415

    run("mode-train", main)


def export() -> None:
    from mode.hf.cli import main  # noqa: PLC0415

    run("mode-export", main)


def prepare() -> None:
    from mode.prepare import main  # noqa: PLC0415

    run("mode-prepare", main)


def evaluate() -> None:
    from mode.eval import main_eval  # noqa: PLC0415

    run("mode-eval", main_eval)


def generate() -> None:
    from mode.eval import main_generate  # noqa: PLC0415

    run("mode-generate", main_generate)


def lm_eval() -> None:
    """lm-evaluation-harness's own command line (``lm-eval run`` arguments) with this library's
    model registered as ``mode``; ``--model`` defaults to it. Needs the ``eval`` extra."""
    try:
        from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

        import mode.eval.harness  # noqa: F401, PLC0415  (registers the model "mode")
    except ImportError as e:
        print(f"mode-lm-eval: {e}: pip install 'mode-moe[eval]'", file=sys.stderr)
        sys.exit(2)
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):  # lm-eval's legacy form: the run subcommand
        args = ["run", *args]
    if args[0] == "run" and not any(a == "--model" or a.startswith("--model=") for a in args):
        args = ["run", "--model", "mode", *args[1:]]
    sys.argv[1:] = args
    run("mode-lm-eval", cli_evaluate)
