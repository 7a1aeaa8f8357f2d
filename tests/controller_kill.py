"""A controller that SIGKILLs itself at a chosen point: the ``kill -9`` of the exactly-once tests.

Run as a script (the tests start it in a subprocess, joined to their Ray)::

    python tests/controller_kill.py GRAPH RUN_DIR --address ADDR [--resume] [--kill WHEN:N] [overrides ...]

``WHEN`` is where iteration ``N`` is cut short, with nothing flushed and no handler run:

- ``generate``: a generation node was just submitted during iteration N (one_step_off and
  streaming: the one for a later iteration, before N's update) and has not finished;
- ``update``: a training node of iteration N was just submitted and has not finished;
- ``save``: the checkpoint of iteration N is half written (every rank wrote its part; the
  controller's part and meta.json are not written).

Without ``--kill`` it runs to the end. The workers, owned by this process, die with it. The
production controller has none of this: ``KillingTrainer`` wraps its worker groups' ``call`` and
runs the test hooks' worker host (``fault_hooks.FaultyWorker``), whose generation nodes start
2 s late under ``--kill generate`` so the kill surely lands before they finish.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import ray

from fault_hooks import FaultyWorker

from hybridflow.controller.executor import RUN_OP
from hybridflow.controller.trainer import Trainer
from hybridflow.graph.dag import load_graph


def die(why: str) -> None:
    print(f"controller_kill: SIGKILL {why}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class KillingTrainer(Trainer):
    worker_cls = FaultyWorker
    kill_when: str | None = None
    kill_at = 0
    iteration = 0

    def step(self, iteration: int) -> dict:
        self.iteration = iteration
        return super().step(iteration)

    def _start_groups(self) -> None:
        super()._start_groups()
        if self.kill_when == "generate":  # a generation outlasts the kill however fast it runs
            for node in (n for n in self.graph.nodes if self.graph.op(n).generates):
                ray.get(self.groups[self.graph.pool_of(node)].call("inject_op_delay", node=node.name, seconds=2.0))
        for group in self.groups.values():
            group.call = self._killing(group.call)

    def _killing(self, call):
        def wrapped(method: str, *args, **kwargs):
            out = call(method, *args, **kwargs)
            if self.iteration != self.kill_at:
                return out
            node = self.graph.node(kwargs["node"]) if method == RUN_OP else None
            if node is not None and self.kill_when == "generate" and self.graph.op(node).generates:
                die(f"during {node.name} (submitted in iteration {self.iteration}), finished: {_done(out)}")
            if node is not None and self.kill_when == "update" and self.graph.op(node).trains:
                die(f"during {node.name} of iteration {self.iteration}, finished: {_done(out)}")
            if method == "save_checkpoint" and self.kill_when == "save":
                ray.get(out)
                die(f"during the checkpoint save of iteration {self.iteration}")
            return out

        return wrapped


def _done(handle) -> bool:
    ready, _ = ray.wait(list(handle.meta_refs), num_returns=len(handle.meta_refs), timeout=0)
    return len(ready) == len(handle.meta_refs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("graph")
    parser.add_argument("run_dir")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--address", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill", help="WHEN:N, WHEN one of generate, update, save")
    args = parser.parse_args()
    trainer = KillingTrainer(load_graph(args.graph, args.overrides), address=args.address,
                             run_dir=args.run_dir, resume=args.resume, verbose=False)
    if args.kill:
        when, at = args.kill.split(":")
        trainer.kill_when, trainer.kill_at = when, int(at)
    trainer.fit()


if __name__ == "__main__":
    main()
