"""What every ``ppswap`` subcommand shares: the error line and exit status, and ``--vpp``
with its default (``ppswap.cli_schedule`` for plan and plot, ``ppswap.cli_demo`` for the demo)."""

from __future__ import annotations

import argparse
import sys

__all__ = [
    "EXIT_USAGE",
    "INTERLEAVED_DEFAULT_VPP",
    "PROG",
    "VPP_HELP",
    "fail",
    "install_hint",
    "vpp_of",
]

PROG = "ppswap"
EXIT_USAGE = 2
INTERLEAVED_DEFAULT_VPP = 2
"""``--vpp`` when it is not given with ``--schedule interleaved_1f1b`` (which needs >= 2)."""
VPP_HELP = (
    f"virtual stages per rank (default: {INTERLEAVED_DEFAULT_VPP} for interleaved_1f1b, "
    "which needs at least 2, and for zbv and dualpipev, which need exactly 2; 1 for the "
    "others)"
)


def vpp_of(args: argparse.Namespace) -> int:
    """``--vpp``, or its default: 2 for interleaved_1f1b, zbv and dualpipev, else 1."""
    if args.vpp is not None:
        return int(args.vpp)
    two_or_more = ("interleaved_1f1b", "zbv", "dualpipev")
    return INTERLEAVED_DEFAULT_VPP if args.schedule in two_or_more else 1


def install_hint(extra: str) -> str:
    """How to install the optional ``extra`` (ppswap is installed from a checkout, not
    from a package index): ``pip install -e '.[extra]'`` in the repository's root."""
    return f"pip install -e '.[{extra}]' in the ppswap checkout"


def fail(message: str) -> int:
    """Print ``ppswap: error: <message>`` on stderr; return the usage exit status."""
    # One write of the whole line: under torchrun every rank writes it to the same stream,
    # and print's separate write of the newline let two ranks' lines run together.
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()
    return EXIT_USAGE
