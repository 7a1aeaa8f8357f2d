"""GRPO: group-relative advantages over 16 samples per prompt, KL loss term, no critic.

The same graph as ``graphs/grpo.yaml``, composed in Python. A short run by default; the
graph file's defaults (the measured run in the README) with ``--iterations 0``::

    python examples/grpo.py                   # 20 iterations
    python examples/grpo.py --iterations 0    # the full default run
"""

from __future__ import annotations

import argparse
import os

from hybridflow import run
from hybridflow.graph.library import grpo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20, help="0 = the graph's default")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    builder = grpo()
    if args.iterations:
        builder.trainer(iterations=args.iterations, val_interval=0)
    summary = run(builder.build(), run_dir=args.run_dir)
    print(summary)


if __name__ == "__main__":
    main()
