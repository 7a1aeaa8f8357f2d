"""GRPO: group-relative advantages over 16 samples per prompt, KL loss term, no critic.

The same graph as ``graphs/grpo.yaml``, composed in Python. A short run by default; the
graph file's defaults (the measured run in the README) with ``--iterations 0``::

    python examples/grpo.py                   # 20 iterations
    python examples/grpo.py --iterations 0    # the full default run
"""

from __future__ import annotations

from example_args import parse_args, run_builder

from hybridflow.graph.library import grpo


def main() -> None:
    run_builder(grpo(), parse_args(__doc__))


if __name__ == "__main__":
    main()
