"""``hybridflow``: run, validate and draw graph files.

    hybridflow run graphs/grpo.yaml [key.path=value ...] [--pools FILE] [--address ADDR]
                                    [--run-dir DIR] [--resume] [--verbose]
    hybridflow serve-reward MODULE:FUNCTION [--host H] [--port P] [--max-request-bytes N]
                            [--ray-serve [--replicas N] [--replica-cpus C] [--address ADDR]]
    hybridflow validate graphs/*.yaml [key.path=value ...] [--pools FILE]
    hybridflow graph graphs/grpo.yaml
    hybridflow plan graphs/grpo.yaml [--pool FILE] [--model-size 7b]
    hybridflow schema [graph|pool] [--out-dir DIR]
    hybridflow docs [--check]
    hybridflow plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--x iteration|wall]
    hybridflow eval graphs/grpo_smollm2.yaml [--actor RUN_DIR] [--k 8] [--json FILE]
    hybridflow replay RUN_DIR --iteration N --node NAME [--rank R] [--pdb]

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
    run.add_argument("--address", help="join this Ray cluster instead of starting a local one "
                     "(default: $RAY_ADDRESS, as `ray job submit` sets it)")
    run.add_argument("--run-dir", help="write the run here (default: trainer.save_dir)")
    run.add_argument(
        "--verbose", action="store_true",
        help="show the workers' own output (library warnings, engine logs) on the console; "
        "without it that goes to RUN_DIR/workers.log",
    )
    run.add_argument(
        "--resume", action="store_true",
        help="continue the run in --run-dir (default: the newest under trainer.save_dir) from its "
        "newest complete checkpoint",
    )

    validate = sub.add_parser("validate", help="check graph files without starting anything")
    validate.add_argument(
        "graphs", nargs="+", metavar="GRAPH_OR_OVERRIDE",
        help="graph files; arguments with '=' are overrides (as for `run`) applied to every file",
    )
    validate.add_argument("--pools", help="resource-pool file to validate placement against")

    graph = sub.add_parser("graph", help="print a graph's nodes, keys and placement")
    graph.add_argument("graph", help="graph YAML file")
    graph.add_argument("overrides", nargs="*", help="dotted overrides, as for `run`")
    graph.add_argument("--out", help="also draw the DAG into this image (png, svg, pdf); needs the `plot` extra")
    graph.add_argument("--pools", help="resource-pool file (default: the graph's `resources`)")

    plan = sub.add_parser("plan", help="auto-map a graph onto a pool: placement, layouts, times")
    plan.add_argument("graph", help="graph YAML file")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, as for `run`")
    plan.add_argument("--pool", help="pool file (default: the graph's `resources`); plans on its first pool")
    plan.add_argument("--model-size", choices=["7b", "13b", "34b", "70b"],
                      help="plan every weighted model as this Llama size, with tp/pp layouts")
    plan.add_argument("--top", type=int, default=5, help="also list this many runner-up plans")

    schema = sub.add_parser("schema", help="write the JSON schemas of graph and pool files")
    schema.add_argument("kind", nargs="?", choices=["graph", "pool"], help="print one schema to stdout")
    schema.add_argument("--out-dir", help="write graph.schema.json and pool.schema.json here")

    docs = sub.add_parser("docs", help="regenerate the reference docs (graph and pool files, the CLI) and schemas under docs/")
    docs.add_argument("--out-dir", default="docs")
    docs.add_argument("--check", action="store_true", help="exit 1 if the docs are stale")

    plot = sub.add_parser("plot", help="plot metrics of one run, or overlay several, into a PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/plot.png, or compare.png for several)")
    plot.add_argument("--x", choices=["iteration", "wall"], default="iteration",
                      help="x axis: the iteration, or wall-clock seconds since the run's first iteration began")

    serve = sub.add_parser("serve-reward", help="serve a rule reward over HTTP (JSON) for remote scoring")
    serve.add_argument("rule", help="'module:function' scoring (prompt, response, ground_truth)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 = any free port (printed)")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20)
    serve.add_argument("--ray-serve", action="store_true",
                       help="serve on Ray Serve replicas behind its HTTP proxy (rewards that outgrow one machine)")
    serve.add_argument("--replicas", type=int, default=1, help="with --ray-serve: Serve replicas of the rule")
    serve.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray-serve: CPUs each replica holds")
    serve.add_argument("--address", help="with --ray-serve: join this Ray cluster instead of starting a local one")

    from hybridflow.cli import eval as eval_cli  # its own module: hybridflow eval
    from hybridflow.cli import replay as replay_cli  # and hybridflow replay

    eval_cli.add_parser(sub)
    replay_cli.add_parser(sub)
    parser.commands = sub.choices  # name -> its parser, for _parse_args
    return parser


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, options and positionals in any order within a command: `run GRAPH
    --run-dir D OVERRIDE ...` as well as `run --run-dir D GRAPH OVERRIDE ...` (argparse alone
    ends a positional list at the first option)."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not (argv and argv[0] in parser.commands):
        return parser.parse_args(argv)
    command = parser.commands[argv[0]]
    args, rest = command.parse_known_args(argv[1:])
    if rest and all(not r.startswith("-") for r in rest):  # positionals after an option
        args = command.parse_intermixed_args(argv[1:])
    elif rest:
        command.error(f"unrecognized arguments: {' '.join(rest)}")
    args.command = argv[0]
    return args


def _cmd_validate(args: argparse.Namespace) -> int:
    from hybridflow.graph.dag import load_graph

    overrides = [a for a in args.graphs if "=" in a]
    paths = [a for a in args.graphs if "=" not in a]
    if not paths:
        raise SpecError("validate", "", f"no graph file given, only overrides {overrides}")
    for path in paths:
        graph = load_graph(path, overrides, pools_file=args.pools)
        print(f"{path}: ok ({len(graph.nodes)} nodes, {len(graph.spec.models)} models)")
    return 0


def _cmd_graph(args: argparse.Namespace) -> int:
    from hybridflow.graph.dag import load_graph
    from hybridflow.graph.render import describe

    from hybridflow.graph.batching import batch_plan

    graph = load_graph(args.graph, args.overrides, pools_file=args.pools)
    print(describe(graph))
    print(batch_plan(graph.spec, graph.layouts, graph.file).describe())
    for name, why in graph.redundant_nodes().items():
        print(f"note: node {name!r} is redundant: {why}")
    if args.out:
        from hybridflow.graph.render import draw

        print(f"wrote {draw(graph, args.out)}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import time

    from hybridflow.graph.dag import build_graph
    from hybridflow.graph.plugins import load_graph_spec
    from hybridflow.placement.automapper import plan_dp, plan_even_batch, train_memory_lines

    # The batch is checked against the plan's layouts, not the whole pool's: plan_even_batch.
    spec = load_graph_spec(args.graph, args.overrides)
    graph = build_graph(spec, args.graph, args.pool, check_batch=False)
    pool_name = next(iter(graph.pools))
    pool = graph.pools[pool_name]
    started = time.perf_counter()
    try:
        mapper, plans, prompts = plan_even_batch(graph, pool, args.model_size, keep=1 + args.top)
    except ValueError as exc:
        raise SpecError(args.pool or graph.spec.resources, f"pools.{pool_name}.profile", str(exc)) from None
    seconds = time.perf_counter() - started
    print(
        f"pool {pool_name!r}: {pool.num_devices} x {pool.device} ({mapper.sim.profile.name}), "
        f"{pool.devices_per_node} per node; {mapper.num_evaluated} plans scored in {seconds:.2f} s"
    )
    for line in train_memory_lines(mapper, pool.num_devices):
        print(line)
    if not plans:
        raise SpecError(graph.file, "models", f"the models do not fit on pool {pool_name!r} in any placement")
    if prompts != spec.data.prompts_per_iteration:
        ranks = ", ".join(f"{m} dp={d}" for m, d in plan_dp(plans[0]).items())
        print(
            f"batch scaled: {spec.data.prompts_per_iteration} -> {prompts} prompts per iteration, "
            f"the fewest this plan's data-parallel ranks split evenly ({ranks}); run it with "
            f"data.prompts_per_iteration={prompts}"
        )
    print(plans[0].describe())
    if len(plans) > 1:
        print("runners-up:" if prompts == spec.data.prompts_per_iteration
              else f"runners-up (scored at {spec.data.prompts_per_iteration} prompts):")
        for plan in plans[1 : 1 + args.top]:
            print(f"  {plan.total:10.4g} s  {plan.key()}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from hybridflow.graph.dag import load_graph
    from hybridflow.placement.automapper import auto_placement

    # fail before Ray starts; `placement: auto` is planned here
    graph = load_graph(args.graph, args.overrides, pools_file=args.pools, planner=auto_placement)
    from hybridflow.controller.trainer import Trainer

    trainer = Trainer(graph, address=args.address, run_dir=args.run_dir, resume=args.resume, verbose=args.verbose)
    print(format_summary(trainer.fit()))
    return 0


def format_summary(summary: dict) -> str:
    """The end-of-run summary as a two-column table, one key per row."""
    def shown(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.4g}"
        return str(value)

    width = max(len(key) for key in summary)
    rows = [f"  {key:<{width}}  {shown(value)}" for key, value in summary.items()]
    return "\n".join(["run summary", *rows])


def _cmd_schema(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from hybridflow.spec.docgen import json_schemas

    schemas = json_schemas()
    if args.kind and not args.out_dir:
        print(json.dumps(schemas[args.kind], indent=2, sort_keys=True))
        return 0
    out_dir = Path(args.out_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind in [args.kind] if args.kind else list(schemas):
        path = out_dir / f"{kind}.schema.json"
        path.write_text(json.dumps(schemas[kind], indent=2, sort_keys=True) + "\n")
        print(path)
    return 0


def _cmd_docs(args: argparse.Namespace) -> int:
    from hybridflow.cli.reference import cli_reference_path, render_cli_reference
    from hybridflow.spec.docgen import stale_files, write_all

    cli_md, cli_text = cli_reference_path(args.out_dir), render_cli_reference()
    if args.check:
        stale = [f"{args.out_dir}/{rel}" for rel in stale_files(args.out_dir)]
        if not cli_md.is_file() or cli_md.read_text() != cli_text:
            stale.append(str(cli_md))
        for path in stale:
            print(f"stale: {path} (run `hybridflow docs`)", file=sys.stderr)
        return 1 if stale else 0
    for path in write_all(args.out_dir):
        print(path)
    cli_md.write_text(cli_text)
    print(cli_md)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from hybridflow.cli.plot import default_out, plot_runs

    print(plot_runs(args.run_dirs, args.out or default_out(args.run_dirs), x=args.x))
    return 0


def _cmd_serve_reward(args: argparse.Namespace) -> int:
    from hybridflow.rewards.server import serve
    from hybridflow.rewards.rule import load_rule

    try:
        load_rule(args.rule)
    except ValueError as exc:
        raise SpecError("serve-reward", "rule", str(exc)) from None
    if not args.ray_serve:
        serve(args.rule, args.host, args.port, args.max_request_bytes)
        return 0
    if args.port == 0 or args.replicas < 1:
        raise SpecError("serve-reward", "--port" if args.port == 0 else "--replicas",
                        "--ray-serve needs a fixed port and at least one replica")
    try:
        from hybridflow.rewards.ray_serve import serve_on_ray
    except ImportError as exc:  # ray[serve]'s own deps
        raise SpecError("serve-reward", "--ray-serve", f"needs Ray Serve ({exc}); install the `serve` "
                        "extra: pip install -e '.[serve]'") from None
    serve_on_ray(args.rule, args.host, args.port, args.replicas, args.replica_cpus, args.address,
                 args.max_request_bytes)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    command = {
        "run": _cmd_run,
        "validate": _cmd_validate,
        "graph": _cmd_graph,
        "plan": _cmd_plan,
        "schema": _cmd_schema,
        "docs": _cmd_docs,
        "plot": _cmd_plot,
        "serve-reward": _cmd_serve_reward,
    }.get(args.command) or args.func
    try:
        return command(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as exc:  # a stopped run, or one whose disk failed it: one line; else a bug
        from hybridflow.controller.recovery import RunStopped, storage_error

        disk = storage_error(exc)
        if disk is not None:
            print(f"stopped: {disk}", file=sys.stderr)
            return 1
        if not isinstance(exc, RunStopped):
            raise
        print(f"stopped: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
