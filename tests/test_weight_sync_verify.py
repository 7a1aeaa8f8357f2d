"""Every weight sync verified (``rollout.verify_sync``): after each sync the rollout engine and
the trainer score a fixed probe; a corrupted tensor or a dropped LoRA adapter stops the run in
one line naming the sync path and the weight version.

Fast tests: the probe and the check on in-process engines. Slow tests: short GRPO runs on real
Ray and gloo, with ``FaultyWorker.corrupt_sync`` corrupting one load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import ray
import torch

from hybridflow.graph.dag import load_graph

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"
SPLIT = ROOT / "graphs" / "grpo_split_rollout.yaml"
SHORT = [
    "trainer.val_interval=0", "trainer.progress=false", "trainer.save_final=false",
    "trainer.save_interval=0", "trainer.sample_interval=0", "data.num_val=0",
    "data.prompts_per_iteration=4", "models.actor.rollout.n=4",
]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _tiny_actor():
    from hybridflow.data.tokenizer import build_char_tokenizer
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.spec.graph import ModelSource

    tokenizer = build_char_tokenizer("abcdefghij")
    module = build_causal_lm(
        ModelSource(config={"hidden_size": 64, "num_hidden_layers": 2}), vocab_size=len(tokenizer),
        pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=0,
    )
    return module, tokenizer


def test_the_probe_is_fixed_and_free_of_special_tokens():
    from hybridflow.hybrid_engine.verify import PROBE_PROMPT, PROBE_RESPONSE, probe_batch, probe_ids

    _, tokenizer = _tiny_actor()
    ids = probe_ids(tokenizer)
    assert ids == probe_ids(tokenizer) and len(ids) == PROBE_PROMPT + PROBE_RESPONSE
    assert not set(ids) & set(tokenizer.all_special_ids) and len(set(ids)) > 1
    batch = probe_batch(tokenizer)
    assert batch["response_mask"].tolist() == [[1] * PROBE_RESPONSE]


def test_a_rollout_module_that_differs_from_the_trainers_is_caught_in_one_line():
    """The transformers rollout on its own copy: equal weights agree (diff 0 within the bound),
    one corrupted tensor is refused naming the path and version."""
    import copy

    from hybridflow.engines.hf_rollout import HFRolloutEngine
    from hybridflow.hybrid_engine.verify import WeightSyncError, probe_ids, verify

    module, tokenizer = _tiny_actor()
    copy_ = copy.deepcopy(module)
    rollout = HFRolloutEngine(copy_, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    expected = HFRolloutEngine(module, eos_id=0, pad_id=0).probe_log_probs(probe_ids(tokenizer), 8).double()
    rng_before = torch.random.get_rng_state()
    ok = verify(expected, rollout, tokenizer, path="full_weights", model="actor", engine="hf",
                version=3, dtype="float32")
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the probe samples nothing
    assert ok["weight_sync/verified"] == 1.0 and ok["weight_sync/probe_diff_max"] == 0.0
    with torch.no_grad():
        weight = copy_.model.layers[0].mlp.down_proj.weight
        weight.copy_(weight.flip(0) * 4.0)
    with pytest.raises(WeightSyncError) as info:
        verify(expected, rollout, tokenizer, path="full_weights", model="actor", engine="hf",
               version=3, dtype="float32")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "weight sync not verified on model 'actor' (sync path full_weights, rollout.engine=hf, weight version 3)"
    ), message
    assert ", first at" not in message  # no way to go over the sent weights was given
    # Given the weights that were sent, a readable engine names the first one it holds otherwise.
    with pytest.raises(WeightSyncError) as info:
        verify(expected, rollout, tokenizer, path="full_weights", model="actor", engine="hf",
               version=3, dtype="float32", sent=module.named_parameters)
    assert ", first at model.layers.0.mlp.down_proj.weight (max |diff| " in str(info.value), str(info.value)


def _stopped_run(graph_file, overrides, tmp_path, *, pool: str, target: str = "tensor", after: int = 1):
    """Run ``graph_file`` with ``corrupt_sync`` armed on ``pool`` after iteration ``after``;
    returns the RunStopped line and the rows logged."""
    from fault_hooks import FaultyTrainer

    from hybridflow.controller.recovery import RunStopped

    trainer = FaultyTrainer(load_graph(graph_file, overrides), run_dir=str(tmp_path / "run"))

    def corrupt(t, iteration, metrics):
        if iteration == after:
            ray.get(t.groups[pool].call("corrupt_sync", model="actor", target=target))

    trainer.callbacks.append(corrupt)
    with pytest.raises(RunStopped) as info:
        trainer.fit()
    return str(info.value), _rows(tmp_path / "run")


@pytest.mark.slow
def test_a_corrupted_tensor_on_the_colocated_hf_path_stops_the_run(ray_session, tmp_path):
    """grpo.yaml (torch + transformers sharing the module): the verified syncs log their probe
    diff, and a sync whose first tensor arrives corrupted stops the run at once, naming
    full_weights and the version that was sent."""
    overrides = [*SHORT, "trainer.iterations=2", "trainer.save_interval=1"]
    message, rows = _stopped_run(GRPO, overrides, tmp_path, pool="default")
    assert "\n" not in message
    assert message.startswith(
        "stopping at iteration 2: weight sync not verified on model 'actor' (sync path full_weights, "
        "rollout.engine=hf, weight version 2): probe log-prob max |diff| "
    ), message
    assert [r["iteration"] for r in rows] == [1]
    assert rows[0]["weight_sync/verified"] == 1.0 and rows[0]["weight_sync/probe_diff_max"] < 1e-5

    # --resume from iteration 1's checkpoint, whose first load into the rollout goes wrong: the
    # sync after the checkpoint load is verified too, and stops in one line as well.
    from fault_hooks import FaultyTrainer

    from hybridflow.controller.recovery import RunStopped

    class CorruptFromTheStart(FaultyTrainer):
        def _start_groups(self) -> None:
            super()._start_groups()
            ray.get(self.groups["default"].call("corrupt_sync", model="actor"))

    resumed = CorruptFromTheStart(load_graph(GRPO, overrides), run_dir=str(tmp_path / "run"), resume=True)
    with pytest.raises(RunStopped) as info:
        resumed.fit()
    message = str(info.value)
    assert "\n" not in message and message.startswith("stopping after loading "), message
    assert "iter_00000001: weight sync not verified on model 'actor' (sync path full_weights, " in message, message
    assert "weight version 1)" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_a_corrupted_tensor_on_a_rollout_pool_stops_the_run(ray_session, tmp_path, engine):
    """grpo_split_rollout.yaml with the rollout on its own pool: the weights cross the object
    store, the rollout pool's load is corrupted and the run stops naming rollout_pool; the
    transformers engine's weights can be read back, so the line also names the corrupted
    parameter (vLLM's CPU weights are repacked: not readable)."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    overrides = [*SHORT, "trainer.iterations=2", "trainer.async.mode=sync", f"models.actor.rollout.engine={engine}"]
    message, rows = _stopped_run(SPLIT, overrides, tmp_path, pool="rollout")
    assert "\n" not in message
    assert f"weight sync not verified on model 'actor' (sync path rollout_pool, rollout.engine={engine}, weight version " in message
    named = re.search(r", first at ([\w.]+) \(max \|diff\| [-+.e\d]+\), stopping$", message)
    assert (named is not None) == (engine == "hf"), message
    assert [r["iteration"] for r in rows] == [1]
    assert rows[0]["weight_sync/verified"] == 1.0 and rows[0]["weight_sync/probe_diff_max"] < 1e-4


@pytest.mark.slow
def test_a_lora_adapter_dropped_before_loading_into_vllm_stops_the_run(ray_session, tmp_path):
    """A LoRA actor whose rollout is vLLM takes adapters each sync; the adapters of the second
    sync are dropped before loading (the sync still says it moved them): vLLM keeps generating
    with the first adapters, and the probe catches it, naming lora_adapter."""
    pytest.importorskip("vllm")
    overrides = [*SHORT, "trainer.iterations=2", "models.actor.rollout.engine=vllm",
                 "models.actor.train.lora.rank=8", "models.actor.train.optim.lr=0.05"]
    message, rows = _stopped_run(GRPO, overrides, tmp_path, pool="default", target="adapter")
    assert "\n" not in message
    assert message.startswith(
        "stopping at iteration 2: weight sync not verified on model 'actor' (sync path lora_adapter, "
        "rollout.engine=vllm, weight version 2)"
    ), message
    assert [r["iteration"] for r in rows] == [1]
    assert rows[0]["weight_sync/verified"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("path", ["resharded", "merged"])
def test_a_corrupted_tensor_on_the_resharded_and_merged_paths_stops_the_run(ray_session, tmp_path, path):
    """The two other sync paths: megatron's training shards gathered through the resharder into
    the transformers rollout (grpo_megatron.yaml, TP = 2), and a LoRA actor's weights with the
    adapters merged in, into vLLM (``lora_sync: merged``). One tensor of the second sync arrives
    corrupted: the run stops in one line naming the path and the version sent."""
    if path == "resharded":
        pytest.importorskip("megatron.core")
        graph_file, overrides = ROOT / "graphs" / "grpo_megatron.yaml", []
        engine = "hf"
    else:
        pytest.importorskip("vllm")
        graph_file, engine = GRPO, "vllm"
        overrides = ["models.actor.rollout.engine=vllm", "models.actor.train.lora.rank=8",
                     "models.actor.rollout.lora_sync=merged", "models.actor.train.optim.lr=0.05"]
    message, rows = _stopped_run(graph_file, [*SHORT, "trainer.iterations=2", *overrides], tmp_path, pool="default")
    assert "\n" not in message
    assert message.startswith(
        f"stopping at iteration 2: weight sync not verified on model 'actor' (sync path {path}, "
        f"rollout.engine={engine}, weight version 2): probe log-prob max |diff| "
    ), message
    assert [r["iteration"] for r in rows] == [1]
    assert rows[0]["weight_sync/verified"] == 1.0 and rows[0]["weight_sync/probe_diff_max"] < 1e-4
