"""Colocation in one worker process: idle train engines to CPU memory, rollout engines offloaded
around ops that do not generate. No Ray: ``tests/gpu/device_check.sh`` runs the GPU case."""

from __future__ import annotations

import pytest


def _engine(device: str):
    """A real torch train engine with AdamW state (after one step): what Colocation moves."""
    import torch

    from hybridflow.engines.torch_engine import TorchTrainEngine
    from hybridflow.spec.engines import TorchTrainSpec

    engine = TorchTrainEngine(torch.nn.Linear(64, 64).to(device), TorchTrainSpec(remove_padding=False))
    engine.module(torch.ones(2, 64, device=device)).sum().backward()
    engine.optimizer.step()
    return engine


def _devices(engine) -> set[str]:
    tensors = [*engine.module.parameters()]
    tensors += [v for st in engine.optimizer.state.values() for k, v in st.items() if k != "step"]
    return {t.device.type for t in tensors}


def test_colocation_on_cpu_switches_without_moving():
    from hybridflow.workers.colocation import Colocation

    engines = {"actor": _engine("cpu"), "ref": _engine("cpu")}
    colocation = Colocation(engines)
    colocation.activate("actor")
    colocation.activate("actor")  # already active: nothing to do
    colocation.activate("ref")
    stats = colocation.stats()
    assert stats["activations"] == 2 and stats["offloads"] == 2 and stats["active"] == "ref"
    assert stats["bytes_offloaded"] == stats["bytes_reloaded"] == 0


@pytest.mark.gpu
def test_colocation_on_gpu_offloads_the_idle_model():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hybridflow.workers.colocation import Colocation

    engines = {"actor": _engine("cuda"), "ref": _engine("cuda")}
    colocation = Colocation(engines)
    colocation.activate("actor")
    assert _devices(engines["actor"]) == {"cuda"} and _devices(engines["ref"]) == {"cpu"}
    per_model = (64 * 64 + 64) * 4 * 3  # weights + Adam exp_avg + exp_avg_sq, fp32
    assert colocation.stats()["bytes_offloaded"] == per_model
    colocation.activate("ref")
    assert _devices(engines["actor"]) == {"cpu"} and _devices(engines["ref"]) == {"cuda"}
    assert colocation.stats()["bytes_reloaded"] == per_model
    engines["ref"].module(torch.ones(1, 64, device="cuda")).sum().backward()
    engines["ref"].optimizer.step()  # the optimizer still works after the round trip


class _Rollout:
    def __init__(self):
        self.moves = []

    def offload(self):
        self.moves.append("off")

    def reload(self):
        self.moves.append("on")


def test_colocation_offloads_rollout_engines_around_ops_that_do_not_generate():
    from hybridflow.workers.colocation import Colocation

    rollout = _Rollout()
    colocation = Colocation({}, {"actor": rollout})
    ops = [("actor", True), ("actor", False), ("ref", False), ("actor", True), ("actor", True), ("reward", False)]
    moves = [colocation.activate(model, generates) for model, generates in ops]
    assert rollout.moves == ["off", "on", "off"]
    assert [m["rollout_offloads"] for m in moves] == [0, 1, 0, 0, 0, 1]
    assert [m["rollout_reloads"] for m in moves] == [0, 0, 0, 1, 0, 0]
    assert colocation.stats()["rollout_offloads"] == 2 and colocation.stats()["rollout_reloads"] == 1
