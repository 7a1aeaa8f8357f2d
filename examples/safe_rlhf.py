"""Safe-RLHF: PPO on a reward and a conflicting cost, two critics, a Lagrange multiplier.

The same graph as ``graphs/safe_rlhf.yaml``, composed in Python. A short run by default; the
graph file's defaults (the measured run in the README) with ``--iterations 0``::

    python examples/safe_rlhf.py                   # 20 iterations
    python examples/safe_rlhf.py --iterations 0    # the full default run
"""

from __future__ import annotations

from example_args import parse_args, run_builder

from hybridflow.graph.library import safe_rlhf


def main() -> None:
    run_builder(safe_rlhf(), parse_args(__doc__))


if __name__ == "__main__":
    main()
