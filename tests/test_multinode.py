"""Two Ray nodes on this machine: a head and a second node process on loopback.

The cluster is this module's own: both nodes are ``ray start --block`` processes in their own
sessions and temp dir, and the driver is a subprocess, so nothing meets the session-scoped
``ray_session`` fixture. Teardown kills exactly those process groups, also on failure; not
``ray stop``, which would stop every Ray process of the user on the machine (other test runs
included).

The driver (this file run as a script) places a graph's two pools on different nodes through
node labels (``resource_pools/two_node_cpu.yaml``), runs two iterations and reports which node
each rank ran on; then it spreads one pool over both nodes (``nodes: 2``) and all-reduces over
gloo across them.

The last test (it kills the second node, so it runs last) spreads a run's one pool over both
nodes with ``trainer.elastic: true``, kills the second node mid-run and checks that the run
finishes on the head alone. The head marks a node dead after 5 failed health checks 1 s apart
(Ray's defaults take about 30 s); only this test cluster is set so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABEL = "hybridflow-node"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_start(temp_dir: str, log: Path, *args: str) -> subprocess.Popen:
    ray_bin = Path(sys.executable).parent / "ray"
    ports = [
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [str(ray_bin), "start", "--block", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
         *ports, *args],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=5)  # then SIGKILL: the group is the test's own
        except subprocess.TimeoutExpired:
            continue
    try:  # raylets and workers left in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# A killed node refuses the check at once, so it is marked dead after 5 checks 1 s apart; a live
# raylet that answers late (a busy machine) has 10 s for each.
HEALTH_CHECKS = '{"health_check_period_ms": 1000, "health_check_timeout_ms": 10000, "health_check_failure_threshold": 5}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The head and the second node: ``address`` and ``second`` (its ``ray start`` process)."""
    logs = tmp_path_factory.mktemp("ray_logs")
    temp_dir = tempfile.mkdtemp(prefix="hf_mn_", dir="/tmp")  # short: socket paths are limited
    port = _free_port()
    procs = [
        _ray_start(temp_dir, logs / "head.log", "--head", f"--port={port}", "--num-cpus=3",
                   "--include-dashboard=false", f"--ray-client-server-port={_free_port()}",
                   f"--labels={LABEL}=head", f"--system-config={HEALTH_CHECKS}"),
    ]
    try:
        address = f"127.0.0.1:{port}"
        _wait_for(address, 1, procs, logs)
        # Ray gives a raylet a fixed 30 s to register (ray/_private/node.py); on a loaded machine
        # (CI, with the suite's leftovers) `ray start` can exit 1 before that. Retry the join.
        for attempt in range(3):
            procs.append(
                _ray_start(temp_dir, logs / f"second{attempt}.log", f"--address={address}",
                           "--num-cpus=2", f"--labels={LABEL}=second")
            )
            try:
                _wait_for(address, 2, procs, logs)
                break
            except RuntimeError:
                if attempt == 2 or procs[0].poll() is not None:
                    raise
                _stop(procs.pop())
        yield SimpleNamespace(address=address, second=procs[-1])
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes(cluster):
    return cluster.address


def _wait_for(address: str, num_nodes: int, procs, logs: Path, timeout_s: float = 240) -> None:
    script = (
        "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                text = "\n".join(p.read_text()[-2000:] for p in logs.glob("*.log"))
                raise RuntimeError(f"ray start exited with {proc.returncode}:\n{text}")
        out = subprocess.run([sys.executable, "-c", script, address], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(num_nodes)]:
            return
        time.sleep(2)
    raise TimeoutError(f"the cluster at {address} did not reach {num_nodes} nodes")


def test_pools_on_different_nodes(two_nodes, tmp_path):
    out = subprocess.run(
        [sys.executable, __file__, two_nodes, str(tmp_path / "run")],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    labels = report["labels"]  # node id -> its label
    assert sorted(labels.values()) == ["head", "second"]
    assert {labels[n] for n in report["ranks"]["actor"]} == {"head"}
    assert {labels[n] for n in report["ranks"]["aux"]} == {"second"}
    assert len(report["ranks"]["actor"]) == 2 and len(report["ranks"]["aux"]) == 1
    assert report["iterations"] == 2 and report["fetched_tensor_bytes"] == 0.0
    # A pool of nodes: 2 puts one rank on each node, and gloo all-reduces across them.
    assert sorted(labels[n] for n in report["spanning"]["nodes"]) == ["head", "second"]
    assert report["spanning"]["sums"] == [3.0, 3.0]


def test_a_run_joins_the_cluster_in_ray_address_and_finds_its_relative_sources(two_nodes, tmp_path):
    """`hybridflow run` with RAY_ADDRESS set (as `ray job submit` sets it) joins that cluster
    instead of starting a Ray; its workers run where the nodes were started (the repository
    root), yet load the actor and the reference from a directory named relative to the run's."""
    from test_model_sources import save_family  # tests/ is on the path, as for graph_variants

    save_family("qwen2", tmp_path / "tiny")
    for name in ("graphs", "resource_pools"):
        (tmp_path / name).symlink_to(ROOT / name)
    out = subprocess.run(
        [str(Path(sys.executable).parent / "hybridflow"), "run", "graphs/grpo.yaml", "models.actor.source={path: tiny}",
         "models.ref.source={path: tiny}", "trainer.iterations=1", "models.actor.rollout.n=4",
         "data.prompts_per_iteration=4", "data.num_val=4", "--run-dir", "runs/joined"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": two_nodes},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "Started a local Ray instance" not in out.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs/joined/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and 0.0 <= rows[0]["reward/mean"] <= 1.0
    # the saved graph keeps the source as the user gave it
    assert "path: tiny" in (tmp_path / "runs/joined/graph.yaml").read_text()


def test_elastic_run_shrinks_when_a_node_dies(cluster, tmp_path):
    """A pool of nodes: 2 (dp 2, one rank per node); the driver SIGKILLs the second node's
    process group after iteration 2 is logged, before its checkpoint: the run goes back to
    iteration 1's checkpoint and finishes at dp 1 on the head, each iteration logged once."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, __file__, "elastic", cluster.address, str(run_dir), str(cluster.second.pid)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    labels = report["labels"]
    assert cluster.second.poll() is not None  # the node is gone
    assert report["summary"]["iterations"] == 4 and report["summary"]["restarts"] == 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in prompts] == [1, 2, 3, 4]
    uids = [u for r in prompts for u in r["uids"]]
    assert len(uids) == 16 and len(set(uids)) == 16  # 4 prompts an iteration, none twice
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["worker_lost", "shrink"]
    shrink = events[1]
    assert shrink["pools"] == {"default": {"before": 2, "after": 1}}
    assert shrink["layouts"]["actor"]["before"]["dp"] == 2 and shrink["layouts"]["actor"]["after"]["dp"] == 1
    assert [labels[n] for n in shrink["lost_nodes"]] == ["second"]
    assert "trainer.elastic restarts on the 1 node(s) left" in out.stderr
    # iterations 1-2 ran on both nodes, 2 (again) to 4 on the head alone
    where = {int(k): sorted(labels[n] for n in v) for k, v in report["ranks"].items()}
    assert where[1] == ["head", "second"]
    assert where[3] == where[4] == ["head"]


# -- the driver ------------------------------------------------------------------------------------


def _driver(address: str, run_dir: str) -> None:
    import ray
    import torch
    import torch.distributed as dist

    from hybridflow.controller.trainer import Trainer
    from hybridflow.graph.dag import load_graph
    from hybridflow.workers.pools import ResourcePool
    from hybridflow.spec.pool import PoolSpec
    from hybridflow.workers.base import Worker
    from hybridflow.workers.group import WorkerGroup
    from hybridflow.workers.protocols import Dispatch, register

    ray.init(address=address, log_to_driver=False)
    labels = {n["NodeID"]: n["Labels"].get(LABEL) for n in ray.nodes() if n["Alive"]}
    graph = load_graph(
        ROOT / "graphs/grpo.yaml",
        ["placement.actor=actor", "placement.ref=aux", "placement.reward=aux",
         "trainer.iterations=2", "trainer.val_interval=0", "trainer.save_final=false",
         "trainer.progress=false", "models.actor.rollout.n=4", "data.prompts_per_iteration=4"],
        pools_file=ROOT / "resource_pools/two_node_cpu.yaml",
    )
    trainer = Trainer(graph, address=address, run_dir=run_dir)
    ranks: dict[str, list[str]] = {}

    def record_nodes(trainer, iteration, metrics):
        for name, group in trainer.groups.items():
            ranks[name] = ray.get(
                [w.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                 for w in group.workers]
            )

    trainer.callbacks.append(record_nodes)
    trainer.fit()

    class SumWorker(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def where_and_sum(self):
            value = torch.tensor([self.rank + 1.0])
            dist.all_reduce(value)
            return ray.get_runtime_context().get_node_id(), float(value)

    pool = ResourcePool("spanning", PoolSpec(nodes=2, devices_per_node=1))
    group = WorkerGroup(SumWorker, pool, {}, name="spanning")
    results = ray.get(group.where_and_sum())
    assert [pool.node_of(rank) for rank in range(2)] == [node for node, _ in results]
    group.shutdown()
    pool.remove()
    print(json.dumps({
        "labels": labels,
        "ranks": ranks,
        "iterations": len(trainer.history),
        "fetched_tensor_bytes": sum(m["controller/fetched_tensor_bytes"] for m in trainer.history),
        "spanning": {"nodes": [node for node, _ in results], "sums": [s for _, s in results]},
    }))


def _elastic_driver(address: str, run_dir: str, second_pid: int) -> None:
    import logging

    import ray

    from hybridflow.controller.trainer import Trainer
    from hybridflow.graph.dag import load_graph

    logging.basicConfig(level=logging.WARNING)
    ray.init(address=address, log_to_driver=False)
    labels = {n["NodeID"]: n["Labels"].get(LABEL) for n in ray.nodes() if n["Alive"]}
    pools = Path(run_dir).parent / "spread.yaml"
    pools.write_text("pools:\n  default: {nodes: 2, devices_per_node: 1}\n")
    graph = load_graph(
        ROOT / "graphs/grpo.yaml",
        ["trainer.elastic=true", "trainer.iterations=4", "trainer.save_interval=1", "trainer.val_interval=0",
         "trainer.save_final=false", "trainer.progress=false", "models.actor.rollout.n=4",
         "data.prompts_per_iteration=4"],
        pools_file=pools,
    )
    trainer = Trainer(graph, address=address, run_dir=run_dir)
    ranks: dict[int, list[str]] = {}
    killed = []

    def record_nodes_then_kill(trainer, iteration, metrics):
        ranks[iteration] = ray.get(
            [w.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
             for w in trainer.groups["default"].workers]
        )
        if iteration == 2 and not killed:
            killed.append(iteration)
            os.killpg(second_pid, signal.SIGKILL)

    trainer.callbacks.append(record_nodes_then_kill)
    summary = trainer.fit()
    print(json.dumps({"labels": labels, "ranks": ranks, "summary": summary}))


if __name__ == "__main__":
    if sys.argv[1] == "elastic":
        _elastic_driver(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        _driver(sys.argv[1], sys.argv[2])
