"""``hybridflow``: run, validate and draw graph files.

    hybridflow run graphs/grpo.yaml [key.path=value ...] [--pools FILE] [--address ADDR]
    hybridflow validate graphs/*.yaml
    hybridflow graph graphs/grpo.yaml

A user mistake (bad file, field, override or data row) prints one line naming the file and the
field and exits with code 2. Heavy packages (Ray, engines) load only for ``run``.
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.spec.loading import SpecError

EXIT_USER_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a graph file")
    run.add_argument("graph", help="graph YAML file")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.iterations=20")
    run.add_argument("--pools", help="resource-pool file (default: the graph's `resources`)")
    run.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    run.add_argument("--run-dir", help="write the run here (default: trainer.save_dir)")

    validate = sub.add_parser("validate", help="check graph files without starting anything")
    validate.add_argument("graphs", nargs="+")
    validate.add_argument("--pools", help="resource-pool file to validate placement against")

    graph = sub.add_parser("graph", help="print a graph's nodes, keys and placement")
    graph.add_argument("graph")
    graph.add_argument("overrides", nargs="*")
    return parser


def _cmd_validate(args: argparse.Namespace) -> int:
    from hybridflow.graph.dag import load_graph

    for path in args.graphs:
        graph = load_graph(path, pools_file=args.pools)
        print(f"{path}: ok ({len(graph.nodes)} nodes, {len(graph.spec.models)} models)")
    return 0


def _cmd_graph(args: argparse.Namespace) -> int:
    from hybridflow.graph.dag import load_graph
    from hybridflow.graph.render import describe

    print(describe(load_graph(args.graph, args.overrides)))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from hybridflow.graph.dag import load_graph

    graph = load_graph(args.graph, args.overrides, pools_file=args.pools)  # fail before Ray starts
    from hybridflow.controller.trainer import Trainer

    trainer = Trainer(graph, address=args.address, run_dir=args.run_dir)
    summary = trainer.fit()
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = {"run": _cmd_run, "validate": _cmd_validate, "graph": _cmd_graph}[args.command]
    try:
        return command(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
