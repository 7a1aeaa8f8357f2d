"""ReMax: one sample per prompt, the actor's greedy answer (its own node) is the baseline.

The same graph as ``graphs/remax.yaml``, composed in Python. A short run by default; the
graph file's defaults (the measured run in the README) with ``--iterations 0``::

    python examples/remax.py                   # 20 iterations
    python examples/remax.py --iterations 0    # the full default run
"""

from __future__ import annotations

import argparse
import os

from hybridflow import run
from hybridflow.graph.library import remax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20, help="0 = the graph's default")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    builder = remax()
    if args.iterations:
        builder.trainer(iterations=args.iterations, val_interval=0)
    summary = run(builder.build(), run_dir=args.run_dir)
    print(summary)


if __name__ == "__main__":
    main()
