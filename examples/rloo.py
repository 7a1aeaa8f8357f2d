"""RLOO: each sample's reward against the mean of the other samples of its prompt.

The same graph as ``graphs/rloo.yaml``, composed in Python. A short run by default; the
graph file's defaults (the measured run in the README) with ``--iterations 0``::

    python examples/rloo.py                   # 20 iterations
    python examples/rloo.py --iterations 0    # the full default run
"""

from __future__ import annotations

from example_args import parse_args, run_builder

from hybridflow.graph.library import rloo


def main() -> None:
    run_builder(rloo(), parse_args(__doc__))


if __name__ == "__main__":
    main()
