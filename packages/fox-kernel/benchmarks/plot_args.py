"""The ``--plot PNG`` / ``--plot-from JSON`` pair that benchmark scripts share: draw while measuring, or draw an
earlier run's JSON on any machine (no GPU)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable


def add_plot_args(ap: argparse.ArgumentParser, what: str) -> None:
    ap.add_argument("--plot", help=f"also draw {what} into this PNG (needs matplotlib)")
    ap.add_argument("--plot-from", help="draw --plot from this earlier JSON instead of measuring")


def plotted_from_json(args: argparse.Namespace, plot: Callable[[dict, str], None]) -> bool:
    """With ``--plot-from``: draws that JSON into ``--plot`` and returns True (the script has nothing more
    to do); else False."""
    if not args.plot_from:
        return False
    if not args.plot:
        raise SystemExit("--plot-from needs --plot PNG")
    plot(read_run(args.plot_from, "--plot-from"), args.plot)
    return True


def read_run(path: str, flag: str) -> dict:
    """An earlier run's JSON, given by the command-line option ``flag``; a missing or broken file is one line
    naming the option."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"{flag}: no such file: {path}") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: {path} is not JSON ({e})") from None
