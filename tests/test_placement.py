"""Placement on real Ray: split pools overlap, serial mode does not, traces, tensor-byte counter.

Reads the timeline the workers recorded (wall-clock start/end per node and rank); nothing here
asserts a speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.graph.dag import load_graph

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "trainer.iterations=3",
    "trainer.val_interval=0",
    "trainer.save_final=false",
    "trainer.progress=false",
    "models.actor.rollout.n=8",
    "data.prompts_per_iteration=8",
]

pytestmark = pytest.mark.slow


def _spans(trace: dict) -> dict[str, tuple[float, float]]:
    """Node -> (start, end) in us over all ranks, from a Chrome trace."""
    spans: dict[str, tuple[float, float]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] != "X":
            continue
        lo, hi = event["ts"], event["ts"] + event["dur"]
        old = spans.get(event["name"], (lo, hi))
        spans[event["name"]] = (min(old[0], lo), max(old[1], hi))
    return spans


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _run(tmp_path: Path, graph_file: str, *, serial: bool = False, load=load_graph):
    from hybridflow.controller.trainer import Trainer

    overrides = [*SMALL, "trainer.trace_interval=1", f"trainer.serial={str(serial).lower()}"]
    trainer = Trainer(load(ROOT / graph_file, overrides), run_dir=str(tmp_path / "run"))
    trainer.fit()
    traces = sorted((tmp_path / "run" / "trace").glob("iteration_*.json"))
    return trainer, [json.loads(path.read_text()) for path in traces]


def test_split_pools_overlap_independent_nodes(ray_session, tmp_path):
    # The file has no work on the actor's pool beside ref_log_prob and reward (one optimizer step
    # per batch needs no old_log_prob node); a graph with that node runs it there beside them.
    from graph_variants import with_old_log_prob

    trainer, traces = _run(tmp_path, "graphs/grpo_split.yaml", load=with_old_log_prob)
    assert len(traces) == 3
    pools = {e["args"]["name"] for t in traces for e in t["traceEvents"] if e["ph"] == "M"}
    assert pools == {"pool actor", "pool aux"}
    ranks = {(e["pid"], e["tid"]) for e in traces[0]["traceEvents"] if e["ph"] == "X"}
    assert len(ranks) == 4  # 2 ranks on each pool
    for trace in traces:
        spans = _spans(trace)
        actor, ref = spans["old_log_prob"], spans["ref_log_prob"]  # different pools, independent
        # Each started before the other ended (run serially they never overlap: the test below).
        # How much they overlap depends on how busy the cores are, so only that is checked.
        assert _overlap(actor, ref) > 0, (actor, ref)
        # Nodes sharing a pool queue on the same processes: on every rank, one after another
        # (a fast rank may start `reward` while a slow one still runs ref_log_prob).
        per_rank: dict[tuple, list] = {}
        for event in trace["traceEvents"]:
            if event["ph"] == "X":
                per_rank.setdefault((event["pid"], event["tid"]), []).append(
                    (event["ts"], event["ts"] + event["dur"])
                )
        for events in per_rank.values():
            events.sort()
            assert all(a[1] <= b[0] for a, b in zip(events, events[1:])), events
    assert all(m["controller/fetched_tensor_bytes"] == 0.0 for m in trainer.history)


def test_serial_mode_runs_one_node_at_a_time(ray_session, tmp_path):
    _, traces = _run(tmp_path, "graphs/grpo_split.yaml", serial=True)
    for trace in traces:
        spans = sorted(_spans(trace).values())
        for before, after in zip(spans, spans[1:]):
            assert before[1] <= after[0], spans


def test_default_grpo_run_fetches_no_tensor_bytes(ray_session, tmp_path):
    from hybridflow.controller.trainer import Trainer

    trainer = Trainer(load_graph(ROOT / "graphs/grpo.yaml", SMALL[:3] + ["trainer.progress=false"]),
                      run_dir=str(tmp_path / "run"))
    trainer.fit()
    assert len(trainer.history) == 3
    assert [m["controller/fetched_tensor_bytes"] for m in trainer.history] == [0.0] * 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["controller/fetched_tensor_bytes"] == 0.0 for row in rows)
    assert not (tmp_path / "run" / "trace").exists()  # tracing is off by default
