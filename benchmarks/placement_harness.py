"""Placement harness: the GRPO graph under every placement, for real on CPU, vs the simulator.

    python benchmarks/placement_harness.py [--devices 3] [--rounds 7] [--iters 2] [--model wide|tiny]
    python benchmarks/placement_harness.py --analyze benchmarks/results/placement_harness_raw.json

1. Calibration (single-node, every model colocated on one pool: three batch shapes on ONE
   device, two on TWO devices, one on THREE at another prompt count): per-node and iteration
   times -> ``calibrate`` fits the CPU profile's effective rates and per-call overheads, and
   ``fit_oversubscription`` its slow-down beyond the physical cores. No placement comparison is
   part of it (the compared placements run ``--prompts`` prompts on ``--devices`` devices).
2. Predictions: the calibrated simulator scores every placement of actor / ref / reward on
   ``--devices`` CPU devices (worker processes) -- every partition into colocated sets and every
   allocation of the devices -- and the auto-mapper picks one.
3. Measurement: one live Trainer per placement (plus one started from ``placement: auto``, which
   goes through the run-start planner), all set up first; then ``--rounds`` rounds, each running
   ``--iters`` iterations of every placement in a fresh random order (interleaved, so machine
   load hits every placement alike); ``--warmup`` iterations first. Median iteration time per
   placement; run-to-run spread = standard deviation of a placement's per-round medians.
4. Spearman rank correlation of predicted vs measured medians; whether auto's choice is the
   fastest or within the spread of it. Writes results JSON, a markdown table and a PNG.

Devices are worker processes with one torch thread each; with more devices than physical
cores they share cores, which the CPU profile models (``Simulator.contention``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _snapshot_package() -> Path:
    """A private copy of ``hybridflow/`` that imports cleanly, used by this driver and (through
    PYTHONPATH) by every worker it starts: the measurement takes tens of minutes and must not
    pick up a half-edited file of a tree that others are changing meanwhile."""
    import shutil
    import subprocess

    for _ in range(10):
        snap = Path(tempfile.mkdtemp(prefix="hybridflow_snapshot_"))
        shutil.copytree(ROOT / "hybridflow", snap / "hybridflow",
                        ignore=shutil.ignore_patterns("__pycache__"))
        check = "import hybridflow.controller.trainer, hybridflow.workers.model_worker, hybridflow.placement.automapper"
        env = dict(os.environ, PYTHONPATH=str(snap))
        if subprocess.run([sys.executable, "-c", check], env=env, cwd=snap).returncode == 0:
            return snap
        shutil.rmtree(snap)
        time.sleep(20)
    raise RuntimeError("hybridflow/ did not import cleanly in 10 tries")


if "--analyze" in sys.argv:
    sys.path.insert(0, str(ROOT))
else:
    SNAPSHOT = _snapshot_package()
    sys.path.insert(0, str(SNAPSHOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SNAPSHOT), os.environ.get("PYTHONPATH", "")])

from hybridflow.graph.dag import build_graph  # noqa: E402
from hybridflow.placement.automapper import (  # noqa: E402
    AutoMapper,
    _allocations,
    auto_placement,
    plan_graph,
)
from hybridflow.placement.profiles import get_profile, save_profile  # noqa: E402
from hybridflow.placement.simulator import (  # noqa: E402
    Measurement,
    all_partitions,
    calibrate,
    fit_oversubscription,
    plan_layout,
)
from hybridflow.graph.plugins import load_graph_spec  # noqa: E402

GRAPH = ROOT / "graphs" / "grpo.yaml"
MODELS = ["actor", "ref", "reward"]
QUIET = [
    "trainer.val_interval=0",
    "trainer.progress=false",
    "trainer.save_final=false",
    "trainer.iterations=100000",
    "trainer.save_interval=0",
    "trainer.sample_interval=0",
    "trainer.log_interval=100000",
]
# Calibration runs (prompts, actor micro-batch, devices): every model colocated on one pool of
# ``devices`` ranks. Different sample counts and micro-batch counts separate per-call overheads
# from per-FLOP rates; the 2-rank runs show how much of each op data parallelism removes (at
# this size, little: per-step and per-call costs do not shrink with a rank's share). A run on
# more ranks than physical cores fits the profile's oversubscription exponent instead (three
# ranks on two cores cost more than a fair share: ranks waiting on each other time-slice).
# None of them is a placement the harness compares (those run --prompts prompts, 12, on
# --devices devices, 3): a shape on as many devices uses another prompt count.
CALIBRATION_SHAPES = [(12, 64, 1), (6, 64, 1), (12, 16, 1), (12, 64, 2), (24, 64, 2), (24, 64, 3)]


# --model: the default graph's tiny model, or a wider one (benchmarks/peers.py's) whose ops are
# compute-bound enough on CPU that data parallelism pays, so placements differ by more than noise.
MODELS_CONFIG = {
    "tiny": {},
    "wide": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2),
}
MODEL_OVERRIDES: list[str] = []  # set from --model in main()


def _spec(prompts: int, micro_batch: int | None = None, extra: list[str] = ()):
    overrides = [f"data.prompts_per_iteration={prompts}", *QUIET, *MODEL_OVERRIDES, *extra]
    if micro_batch is not None:
        overrides.append(f"models.actor.train.micro_batch_size={micro_batch}")
    return load_graph_spec(GRAPH, overrides)


def _pool(devices: int, profile: str | None = None) -> dict:
    pool = {"nodes": 1, "devices_per_node": devices, "device": "cpu", "cpus_per_device": 1,
            "threads_per_device": 1}
    if profile:
        pool["profile"] = profile
    return pool


def _graph(spec, pools: dict, placement, tmp: Path, tag: str, planner=None):
    pool_file = tmp / f"pools_{tag}.yaml"
    pool_file.write_text(yaml.safe_dump({"pools": pools}))
    spec = spec.model_copy(update={"placement": placement})
    return build_graph(spec, GRAPH, pool_file, planner=planner)


def _trainer(graph, tmp: Path, tag: str):
    from hybridflow.controller.trainer import Trainer

    trainer = Trainer(graph, run_dir=str(tmp / f"run_{tag}"))
    trainer._setup()  # fit() would run every iteration at once; the harness interleaves steps
    return trainer


def _step(trainer, counter: list[int]) -> dict:
    counter[0] += 1
    return trainer.step(counter[0])


# -- 1. calibration -------------------------------------------------------------------------------


def run_calibration(
    tmp: Path, warmup: int, iters: int, log, max_devices: int, compared_prompts: int
) -> tuple[object, list[dict]]:
    """Fit the CPU profile from colocated single-node runs that are not compared placements."""
    measurements, rows, oversubscribed = [], [], []
    base = get_profile("cpu")
    cores = base.physical_cores or 1
    sim_graph = None
    shapes = [s for s in CALIBRATION_SHAPES
              if s[2] == 1 or s[2] < max_devices or (s[2] == max_devices and s[0] != compared_prompts)]
    for prompts, micro, devices in shapes:
        tag = f"calib{prompts}_{micro}_{devices}"
        spec = _spec(prompts, micro)
        graph = _graph(spec, {"calib": _pool(devices)}, {m: "calib" for m in MODELS}, tmp, tag)
        trainer = _trainer(graph, tmp, tag)
        counter = [0]
        try:
            for _ in range(warmup):
                _step(trainer, counter)
            history = [_step(trainer, counter) for _ in range(iters)]
        finally:
            trainer.shutdown()
        pg = plan_graph(graph)
        sim_graph = pg
        mapper = AutoMapper(pg, base, devices, devices)
        layout = plan_layout(d=devices)  # each rank's share of the work
        shape = f"P={prompts} mb={micro} ranks={devices}"
        iteration_work: dict[str, float] = {}
        if devices > cores:  # not a linear measurement: kept for the oversubscription fit
            seconds = statistics.median(h["timing/iteration"] for h in history)
            work = [mapper.node_work(node, layout, mapper.sim.usable_memory()) for node in pg.nodes]
            oversubscribed.append((devices, seconds, work, shape))
            log(f"calibration {shape}: iteration {seconds:.3f} s (oversubscribed)")
            continue
        for node in pg.nodes:
            work = mapper.node_work(node, layout, mapper.sim.usable_memory())
            for k, v in work.items():
                iteration_work[k] = iteration_work.get(k, 0.0) + v
            op_work = {k: v for k, v in work.items() if k != "overhead:dispatch"}
            seconds = statistics.median(h[f"timing/{node.name}"] for h in history)
            measurements.append(Measurement(op_work, seconds, f"{node.name} {shape}"))
            rows.append({"shape": shape, "node": node.name, "seconds": seconds})
        seconds = statistics.median(h["timing/iteration"] for h in history)
        measurements.append(Measurement(iteration_work, seconds, f"iteration {shape}"))
        rows.append({"shape": shape, "node": "iteration", "seconds": seconds})
        log(f"calibration {shape}: iteration {seconds:.3f} s")
    mapper = AutoMapper(sim_graph, base, 1, 1)
    profile = calibrate(mapper.sim, measurements)
    fitted = AutoMapper(sim_graph, profile, 1, 1).sim
    linear = [sum(fitted.time(w) for w in work) for _, _, work, _ in oversubscribed]
    for (devices, seconds, _, shape), no_contention in zip(oversubscribed, linear):
        profile = fit_oversubscription(profile, devices, seconds, no_contention)
        log(f"calibration {shape}: {seconds:.3f} s vs {no_contention:.3f} s without contention -> "
            f"oversubscription exponent {profile.oversubscription:.2f}")
    for m, row in zip(measurements, rows, strict=True):
        row["fitted_seconds"] = fitted.time(m.work)
    final = AutoMapper(sim_graph, profile, 1, 1).sim  # with the oversubscription term
    for (devices, seconds, _, shape), no_contention in zip(oversubscribed, linear):
        rows.append({"shape": shape, "node": "iteration", "seconds": seconds,
                     "fitted_seconds": no_contention * final.contention(devices)})
    return profile, rows


# -- 2./3. placements -----------------------------------------------------------------------------


def placements(devices: int) -> list[list[tuple[tuple[str, ...], int]]]:
    sizes = list(range(1, devices + 1))
    out = []
    for partition in all_partitions(MODELS):
        for alloc in _allocations(devices, [sizes] * len(partition)):
            out.append(list(zip(partition, alloc)))
    return out


def placement_name(sets) -> str:
    if len(sets) == 1:
        return f"colocate-all:{sets[0][1]}"
    if all(len(models) == 1 for models, _ in sets):
        return "standalone " + ", ".join(f"{m[0]}:{n}" for m, n in sets)
    return ", ".join(f"{'+'.join(m)}:{n}" for m, n in sets)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=3, help="CPU devices (worker processes)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iters", type=int, default=2, help="measured iterations per placement per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=12, help="prompts per iteration (x16 samples)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS_CONFIG), default="wide",
                        help="model of actor and ref: the default graph's, or hidden 256 x 4 layers")
    parser.add_argument("--analyze", help="only re-analyse a raw JSON written by an earlier run")
    args = parser.parse_args(argv)
    MODEL_OVERRIDES[:] = [
        f"models.{model}.source.config.{key}={value}"
        for model in ("actor", "ref") for key, value in MODELS_CONFIG[args.model].items()
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads(Path(args.analyze).read_text()) if args.analyze else measure(args, out)
    result = analyze(raw)
    (out / "placement_harness.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / "placement_harness.md").write_text(table)
    print(table)
    plot(result, out / "placement_harness.png")
    return 0


def measure(args, out: Path) -> dict:
    started = time.time()
    load_before = os.getloadavg()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {msg}", flush=True)

    import ray

    ray.init(
        num_cpus=64,  # logical: pools reserve 1 each; physical cores are what they share
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                  "PYTHONPATH": os.environ["PYTHONPATH"]}},
    )
    import hybridflow

    log(f"code: {Path(hybridflow.__file__).parent} (snapshot of {ROOT / 'hybridflow'})")
    tmp = Path(tempfile.mkdtemp(prefix="placement_harness_"))
    profile, calibration_rows = run_calibration(tmp, args.warmup, max(args.iters, 5), log, args.devices, args.prompts)
    profile_file = out / "cpu_calibrated.yaml"
    save_profile(profile, profile_file)
    log(f"calibrated profile -> {profile_file}")

    spec = _spec(args.prompts)
    graphs = {}
    for i, sets in enumerate(placements(args.devices)):
        pools = {f"p{i}s{j}": _pool(n) for j, (_, n) in enumerate(sets)}
        placement = {m: f"p{i}s{j}" for j, (models, _) in enumerate(sets) for m in models}
        graphs[placement_name(sets)] = (_graph(spec, pools, placement, tmp, f"p{i}"), sets)
    # `placement: auto` through the run-start planner, on one pool of all the devices
    auto_graph = _graph(
        spec, {"auto": _pool(args.devices, str(profile_file))}, "auto", tmp, "auto", planner=auto_placement
    )
    auto_sets = [
        (tuple(auto_graph.models_on(p)), auto_graph.pools[p].num_devices)
        for p in dict.fromkeys(auto_graph.placement.values())
    ]
    auto_name = placement_name(auto_sets)
    log(f"auto chose: {auto_name}")
    graphs["auto"] = (auto_graph, auto_sets)

    mapper = AutoMapper(plan_graph(auto_graph), profile, args.devices, args.devices)
    predicted = {name: mapper.evaluate(sets) for name, (_, sets) in graphs.items()}
    search = mapper.search(keep=len(graphs))
    log("predicted: " + ", ".join(f"{n} {p.total:.3f}" for n, p in sorted(predicted.items(), key=lambda kv: kv[1].total)))

    trainers, failed = {}, {}
    for name, (graph, _) in graphs.items():
        try:
            trainers[name] = _trainer(graph, tmp, f"h{len(trainers) + len(failed)}")
        except Exception as exc:  # noqa: BLE001 -- measure the rest, report this one
            failed[name] = f"{type(exc).__name__}: {str(exc)[-300:]}"
            log(f"FAILED to set up {name}: {failed[name]}")
            continue
        log(f"set up {name}")
    counters = {name: [0] for name in trainers}
    for name, trainer in trainers.items():
        for _ in range(args.warmup):
            _step(trainer, counters[name])
    rng = random.Random(args.seed)
    raw = {
        "devices": args.devices,
        "physical_cores": os.cpu_count(),
        "rounds": 0,
        "iters_per_round": args.iters,
        "warmup": args.warmup,
        "prompts_per_iteration": args.prompts,
        "model": args.model,
        "loadavg_before": load_before,
        "calibration": calibration_rows,
        "profile": profile.to_dict(),
        "auto_choice": auto_name,
        "search_order": [p.key() for p in search],
        "placements": {
            name: {"sets": [[list(m), n] for m, n in sets], "predicted_s": predicted[name].total,
                   "predicted_node_s": predicted[name].node_times, "times": [], "round_medians": [],
                   "node_times": {}}
            for name, (_, sets) in graphs.items() if name in trainers
        },
        "failed": failed,
    }
    loads = []
    for r in range(args.rounds):
        order = list(trainers)
        rng.shuffle(order)
        for name in order:
            entry = raw["placements"][name]
            this_round = []
            for _ in range(args.iters):
                metrics = _step(trainers[name], counters[name])
                this_round.append(metrics["timing/iteration"])
                for k, v in metrics.items():
                    if k.startswith("timing/") and k != "timing/iteration":
                        entry["node_times"].setdefault(k[7:], []).append(v)
            entry["times"].extend(this_round)
            entry["round_medians"].append(statistics.median(this_round))
        loads.append(os.getloadavg()[0])
        raw["rounds"] = r + 1
        raw["loadavg_per_round"] = loads
        raw["wall_s"] = time.time() - started
        (out / "placement_harness_raw.json").write_text(json.dumps(raw, indent=2))
        log(f"round {r + 1}/{args.rounds} done (load average {loads[-1]:.1f})")
    for trainer in trainers.values():
        trainer.shutdown()
    ray.shutdown()
    raw["loadavg_after"] = os.getloadavg()
    raw["wall_s"] = time.time() - started
    (out / "placement_harness_raw.json").write_text(json.dumps(raw, indent=2))
    return raw


def analyze(raw: dict) -> dict:
    rows = []
    for name, entry in raw["placements"].items():
        medians = entry["round_medians"]
        rows.append({
            "placement": name,
            "predicted_s": entry["predicted_s"],
            "measured_median_s": statistics.median(entry["times"]),
            "spread_s": statistics.stdev(medians) if len(medians) > 1 else 0.0,
            "iqr_s": _iqr(entry["times"]),
            "round_medians_s": medians,
            "iterations": len(entry["times"]),
            "node_median_s": {k: statistics.median(v) for k, v in entry["node_times"].items()},
            "predicted_node_s": entry.get("predicted_node_s", {}),
        })
    comparable = [r for r in rows if r["placement"] != "auto"]
    rho = spearman([r["predicted_s"] for r in comparable], [r["measured_median_s"] for r in comparable])
    fastest = min(comparable, key=lambda r: r["measured_median_s"])
    auto_row = next((r for r in rows if r["placement"] == "auto"), None)
    auto_name = raw["auto_choice"]
    if auto_row is None:  # the auto run failed to start: judge the placement it chose instead
        auto_row = next(r for r in comparable if r["placement"] == auto_name)
    same_as = next((r for r in comparable if r["placement"] == auto_name), None)
    tolerance = max(fastest["spread_s"], auto_row["spread_s"])
    verdict = {
        "auto_choice": auto_name,
        "auto_measured_s": auto_row["measured_median_s"],
        "auto_choice_measured_as_named_placement_s": same_as["measured_median_s"] if same_as else None,
        "fastest": fastest["placement"],
        "fastest_measured_s": fastest["measured_median_s"],
        "spread_s": tolerance,
        "auto_is_fastest": auto_name == fastest["placement"],
        "auto_within_spread": auto_row["measured_median_s"] <= fastest["measured_median_s"] + tolerance,
        "spearman": rho,
    }
    keep = {k: v for k, v in raw.items() if k != "placements"}
    return {**keep, "placements": rows, "verdict": verdict}


def _iqr(values: list[float]) -> float:
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def markdown(result: dict) -> str:
    v = result["verdict"]
    lines = [
        f"{result['devices']} CPU devices on {result['physical_cores']} physical cores, "
        f"{result.get('model', 'tiny')} model, {result.get('prompts_per_iteration', '?')} prompts x 16 samples; "
        f"{result['rounds']} interleaved rounds x {result['iters_per_round']} iterations after "
        f"{result['warmup']} warm-up; 1-min load average before {result['loadavg_before'][0]:.1f}, "
        f"per round {', '.join(f'{x:.0f}' for x in result.get('loadavg_per_round', []))}; "
        f"wall {result.get('wall_s', 0):.0f} s.",
        "",
        "| placement | predicted (s) | measured median (s) | spread (s, sd of round medians) | IQR (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(result["placements"], key=lambda r: r["measured_median_s"]):
        label = f"auto = {v['auto_choice']}" if r["placement"] == "auto" else r["placement"]
        lines.append(
            f"| {label} | {r['predicted_s']:.3f} | {r['measured_median_s']:.3f} | "
            f"{r['spread_s']:.3f} | {r['iqr_s']:.3f} |"
        )
    lines += [
        "",
        f"- Spearman (predicted vs measured, {len(result['placements']) - 1} placements, auto excluded): "
        f"**{v['spearman']:.2f}**",
        f"- auto chose `{v['auto_choice']}`; measured {v['auto_measured_s']:.3f} s (as `auto`), "
        f"fastest `{v['fastest']}` {v['fastest_measured_s']:.3f} s, spread {v['spread_s']:.3f} s -> "
        f"auto is fastest: {v['auto_is_fastest']}, within spread: {v['auto_within_spread']}",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["placements"]
    fig, ax = plt.subplots(figsize=(7.5, 6))
    xs = [r["predicted_s"] for r in rows]
    ys = [r["measured_median_s"] for r in rows]
    err = [r["spread_s"] for r in rows]
    ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3)
    for r in rows:
        ax.annotate(r["placement"], (r["predicted_s"], r["measured_median_s"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
    ax.plot([lo, hi], [lo, hi], "--", color="grey", lw=1, label="measured = predicted")
    ax.set_xlabel("predicted iteration time (s), calibrated CPU profile")
    ax.set_ylabel("measured median iteration time (s)")
    ax.set_title(f"GRPO placements on {result['devices']} CPU devices "
                 f"(Spearman {result['verdict']['spearman']:.2f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
