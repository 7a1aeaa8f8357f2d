"""ReMax: one sample per prompt, the actor's greedy answer (its own node) is the baseline.

The same graph as ``graphs/remax.yaml``, composed in Python. A short run by default; the
graph file's defaults (the measured run in the README) with ``--iterations 0``::

    python examples/remax.py                   # 20 iterations
    python examples/remax.py --iterations 0    # the full default run
"""

from __future__ import annotations

from example_args import parse_args, run_builder

from hybridflow.graph.library import remax


def main() -> None:
    run_builder(remax(), parse_args(__doc__))


if __name__ == "__main__":
    main()
