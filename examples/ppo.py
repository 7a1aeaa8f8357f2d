"""PPO: actor + critic (value head), GAE advantages, KL to the reference inside the reward.

The same graph as ``graphs/ppo.yaml``, composed in Python. A short run by default; the
graph file's defaults (the measured run in the README) with ``--iterations 0``::

    python examples/ppo.py                   # 20 iterations
    python examples/ppo.py --iterations 0    # the full default run
"""

from __future__ import annotations

from example_args import parse_args, run_builder

from hybridflow.graph.library import ppo


def main() -> None:
    run_builder(ppo(), parse_args(__doc__))


if __name__ == "__main__":
    main()
