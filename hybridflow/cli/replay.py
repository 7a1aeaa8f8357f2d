"""``hybridflow replay``: run one recorded node call again, without Ray, and compare its outputs.

    hybridflow replay RUN_DIR --iteration N --node NAME [--rank R] [--pdb]

The run recorded the node at that iteration (``trainer.record``; ``workers.recording``). Every
rank of the call runs again in a process of its own on a local gloo group of the recorded world
size (rank R in this one), from the recorded state, and each rank's outputs are compared with
the recorded ones: one line per rank, ``equal`` or the first difference, then a verdict line.
Exit code 0 when every rank is equal, 1 when one differs, 2 on a call that was not recorded
(the line lists what was). ``--pdb`` stops in rank R's body under the debugger.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from hybridflow.spec.loading import SpecError

_ITERATION_DIR = re.compile(r"iter_(\d+)")


def add_parser(sub) -> None:
    rp = sub.add_parser("replay", help="run a recorded node call again in plain processes and compare its outputs")
    rp.add_argument("run_dir", metavar="RUN_DIR", help="run directory of a run with trainer.record")
    rp.add_argument("--iteration", type=int, required=True, help="recorded iteration")
    rp.add_argument("--node", required=True, help="recorded node name")
    rp.add_argument("--rank", type=int, default=0,
                    help="the rank run in this process (the others run in processes of their own)")
    rp.add_argument("--pdb", action="store_true", help="stop in --rank's op body under the debugger (pdb)")
    rp.set_defaults(func=cmd_replay)


def recorded_calls(run_dir: Path) -> dict[int, list[str]]:
    """Iteration -> the nodes recorded at it, in ``run_dir``."""
    from hybridflow.workers.recording import INFO, RECORD

    calls: dict[int, list[str]] = {}
    for info in sorted((run_dir / RECORD).glob(f"iter_*/*/{INFO}")):
        match = _ITERATION_DIR.fullmatch(info.parent.parent.name)
        if match:
            calls.setdefault(int(match.group(1)), []).append(info.parent.name)
    return dict(sorted(calls.items()))


def find_record(run_dir: Path, iteration: int, node: str) -> Path:
    """The record of ``node`` at ``iteration``; SpecError (listing what was recorded) if there is
    none, or if a rank's part is missing."""
    from hybridflow.workers.recording import OUTPUT, rank_dir, record_dir
    from hybridflow.workers.replay import read_info

    if not run_dir.is_dir():
        raise SpecError(run_dir, "", "run directory not found")
    calls = recorded_calls(run_dir)
    if not calls:
        raise SpecError(run_dir, "trainer.record", "the run recorded no node (set trainer.record: "
                        "{nodes: [NAME, ...], iterations: [N, ...]} and run it)")
    listed = "; ".join(f"iteration {i}: {', '.join(nodes)}" for i, nodes in calls.items())
    if iteration not in calls:
        raise SpecError(run_dir, "--iteration", f"iteration {iteration} was not recorded; recorded: {listed}")
    if node not in calls[iteration]:
        raise SpecError(run_dir, "--node", f"node {node!r} was not recorded at iteration {iteration}; recorded: {listed}")
    path = record_dir(run_dir, iteration, node)
    for rank in range(read_info(path)["world_size"]):
        if not (rank_dir(path, rank) / OUTPUT).is_file():
            raise SpecError(rank_dir(path, rank), OUTPUT, "not written: the run stopped during this call")
    return path


def cmd_replay(args: argparse.Namespace) -> int:
    from hybridflow.workers.replay import ReplayError, read_info, replay

    run_dir = Path(args.run_dir)
    path = find_record(run_dir, args.iteration, args.node)
    world_size = read_info(path)["world_size"]
    if not 0 <= args.rank < world_size:
        raise SpecError(path, "--rank", f"rank {args.rank}: the call ran on {world_size} rank(s), 0 to {world_size - 1}")
    print(f"replaying node {args.node!r} of iteration {args.iteration} on {world_size} rank(s), without Ray", flush=True)
    try:
        differences = replay(path, str(run_dir / "tokenizer"), rank=args.rank, debug=args.pdb)
    except ReplayError as err:  # a rank's own traceback: the replay could not run, not a difference
        print(f"replay failed: {err}", file=sys.stderr)
        return _end(args, 1)
    for rank, difference in differences.items():
        print(f"rank {rank}: {difference or 'equal'}")
    differing = [rank for rank, difference in differences.items() if difference]
    print(f"differs on rank(s) {differing}" if differing else "equal")
    return _end(args, 1 if differing else 0)


def _end(args: argparse.Namespace, code: int) -> int:
    """Under --pdb the debugged rank's worker lives in this process (``replay._KEPT``): end the
    process here, without a teardown of its process groups, which can deadlock."""
    if args.pdb:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
