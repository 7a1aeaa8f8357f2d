"""The command line the examples share: ``--iterations`` and ``--run-dir``.

Imported by the scripts next to it (``python examples/NAME.py`` puts this folder on the path).
"""

from __future__ import annotations

import argparse
import os


def parse_args(doc: str, **extra: dict) -> argparse.Namespace:
    """``--iterations`` (default 20; 0 keeps the graph's own), ``--run-dir``, and ``extra`` flags
    (``"--flag": add_argument kwargs``). Also lets a local Ray start without an auth token."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20, help="0 = the graph's default")
    parser.add_argument("--run-dir", default=None, help="default: a new folder under trainer.save_dir")
    for flag, kwargs in extra.items():
        parser.add_argument(flag, **kwargs)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    return args


def run_builder(builder, args: argparse.Namespace, **trainer) -> None:
    """Build and run ``builder``'s graph and print its summary. A non-zero ``--iterations``
    shortens the run (and turns validation off unless ``trainer`` sets it)."""
    from hybridflow import run

    if args.iterations:
        builder.trainer(**({"iterations": args.iterations, "val_interval": 0} | trainer))
    print(run(builder.build(), run_dir=args.run_dir))
