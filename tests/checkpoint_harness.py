"""Reading checkpoints in tests: a model's torch.distributed.checkpoint as full tensors; and
killing a worker mid-run, then checking every batch was trained once.

Not a test module (imported by name by the checkpoint, resume and async tests).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def saved_state(checkpoint: Path, model: str = "actor") -> dict:
    """Every entry of ``checkpoint``'s state of ``model``, tensors whole (one process)."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(Path(checkpoint) / "models" / model, Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", weights_only=False)


def saved_weights(checkpoint: Path, model: str = "actor") -> dict[str, torch.Tensor]:
    """The weights of ``model`` in ``checkpoint`` (torch engine: HF names)."""
    return saved_state(checkpoint, model)["model"]


def kill_worker_after(iteration: int, pool: str, rank: int):
    """A trainer callback that SIGKILLs rank ``rank`` of pool ``pool`` 50 ms after iteration
    ``iteration`` is logged (during the next one), once."""
    import os
    import signal
    import threading

    import ray

    killed = []

    def callback(trainer, done: int, metrics: dict) -> None:
        if done == iteration and not killed:
            worker = trainer.groups[pool].workers[rank]
            pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
            threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
            killed.append(pid)

    return callback


def assert_each_batch_trained_once(trainer, run_dir: Path, iterations: int, prompts_per_iteration: int) -> None:
    """Iteration i's logged samples answer prompts of the dataset's i-th batch (none skipped,
    none trained twice), and the final checkpoint counts ``iterations`` batches. Needs
    ``trainer.sample_interval=1`` and a checkpoint at the last iteration."""
    from hybridflow.controller.checkpoint import checkpoint_dir, load_controller_state
    from hybridflow.data import keys as K

    dataset = trainer.dataset
    dataset.load_state_dict({"epoch": 0, "position": 0, "next_uid": 0, "num_rows": len(dataset)})
    batches = [set(dataset.next_batch().get(K.PROMPT_TEXT).tolist()) for _ in range(iterations)]
    samples = [json.loads(line) for line in (Path(run_dir) / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["iteration"] for s in samples}) == list(range(1, iterations + 1))
    for sample in samples:
        assert sample["prompt"] in batches[sample["iteration"] - 1], sample
    state = load_controller_state(checkpoint_dir(run_dir, iterations))["dataset"]
    state = state.get("dataset", state)  # generation ahead: the position with the buffered batches
    done = iterations * prompts_per_iteration
    assert (state["position"], state["next_uid"]) == (done, done)
