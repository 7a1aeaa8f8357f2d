"""LoRA on the actor (``train.lora``): adapters-only training, the reference as the base model
with the adapters disabled, adapter-only sync into vLLM, and checkpoints of the adapters."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hybridflow.data import keys as K
from hybridflow.data.tasks import get_task
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.hf_rollout import HFRolloutEngine
from hybridflow.engines.lora import BaseModelEngine, base_named_weights
from hybridflow.engines.models import build_causal_lm
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.graph.dag import load_graph
from hybridflow.spec.engines import TorchTrainSpec
from hybridflow.spec.graph import LoraSpec, ModelSource
from hybridflow.spec.loading import SpecError
from test_model_sources import _prompts, save_family

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"
LORA = LoraSpec(rank=4, alpha=8)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("llama"))


def _model(directory):
    tokenizer = get_task("copy").tokenizer()
    return build_causal_lm(ModelSource(path=directory), len(tokenizer), tokenizer.pad_token_id,
                           tokenizer.eos_token_id, seed=0), tokenizer


def _rollout_batch(model, tokenizer):
    rollout = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return rollout.generate(_prompts(tokenizer), SamplingParams(n=2, max_new_tokens=5))


def _reinforce(mb, fwd):
    return -(fwd["log_probs"] * mb[K.RESPONSE_MASK]).sum() / fwd["num_global_tokens"], {}


def _lora_engine(directory, lr=0.05):
    model, tokenizer = _model(directory)
    engine = TorchTrainEngine(model, TorchTrainSpec(micro_batch_size=4, optim={"lr": lr}, lora=LORA))
    return engine, model, tokenizer


def test_lora_engine_trains_the_adapters_only(llama_dir):
    engine, model, tokenizer = _lora_engine(llama_dir)
    batch = _rollout_batch(model, tokenizer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: q, k, v, o, gate, up, down of each layer, never the (tied) head
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.train_step(batch, _reinforce)
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    # B starts at 0, so one step moves B only; A moves from the second step on
    assert changed and changed <= trainable
    engine.train_step(batch, _reinforce)
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed == trainable
    # AdamW state exists for the adapters and nothing else
    state_params = {id(p) for p in engine.optimizer.state}
    assert state_params == {id(p) for n, p in model.named_parameters() if n in trainable}


def test_reference_is_the_base_model_with_adapters_disabled(llama_dir):
    engine, model, tokenizer = _lora_engine(llama_dir)
    batch = _rollout_batch(model, tokenizer)
    for _ in range(2):
        engine.train_step(batch, _reinforce)
    base, _ = _model(llama_dir)
    want = TorchTrainEngine(base, TorchTrainSpec(micro_batch_size=4)).forward(batch)["log_probs"]
    ref = BaseModelEngine(engine).forward(batch)["log_probs"]
    assert torch.equal(ref, want)  # the disabled adapters take no part in the sum
    actor = engine.forward(batch)["log_probs"]
    mask = batch[K.RESPONSE_MASK].bool()
    assert (actor - want)[mask].abs().max() > 1e-3  # the adapters did train
    # the base weights under HF names are the untouched base
    base_weights = dict(base.named_parameters())
    for name, tensor in base_named_weights(model):
        assert torch.equal(tensor, base_weights[name]), name
    assert {n for n, _ in base_named_weights(model)} == set(base_weights)


def test_graph_serves_a_same_source_ref_from_the_lora_actor(tmp_path):
    lora = ["models.actor.train.lora.rank=4"]
    graph = load_graph(GRPO, lora)
    assert graph.base_of("ref") == "actor"
    assert graph.base_of("actor") is None and graph.base_of("reward") is None
    assert load_graph(GRPO).base_of("ref") is None  # full fine-tuning: a copy of its own
    other = load_graph(GRPO, lora + ["models.ref.source.config.hidden_size=32"])
    # (the override changes the ref only, though both name the file's &tiny anchor)
    assert other.spec.models["actor"].source.config["hidden_size"] == 64
    assert other.base_of("ref") is None  # another model: built as before
    with pytest.raises(SpecError, match=r"models\.ref\.train\.lora.*actor"):
        load_graph(GRPO, ["models.ref.train.lora.rank=4"])
    with pytest.raises(SpecError, match=r"lora.*torch"):
        load_graph(GRPO, ["models.actor.train.engine=megatron", "models.actor.train.lora.rank=4"])


@pytest.mark.slow
@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_vllm_after_an_adapter_sync_equals_the_merged_model(llama_dir, lora_sync):
    """Greedy, float32: vLLM with the synced adapters generates the merged model's tokens, and a
    second sync (new weights under a new adapter id) is taken too. Adapters go through a
    shared-memory directory (first sync), then are built in memory (second); under
    ``lora_sync: merged`` a vLLM without LoRA takes the weights merged in the train process."""
    from hybridflow.engines.vllm import VLLMRolloutEngine

    engine, model, tokenizer = _lora_engine(llama_dir)
    prompts = _prompts(tokenizer)
    greedy = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    merged = lora_sync == "merged"
    vllm = VLLMRolloutEngine.build(model, tokenizer, max_model_len=16, max_num_seqs=4, seed=0,
                                   adapter_config=None if merged else engine.adapter_config())

    def merged_tokens():
        merged = copy.deepcopy(engine.peft).merge_and_unload()
        hf = HFRolloutEngine(merged, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
        return hf.generate(prompts, greedy)[K.RESPONSES]

    base_tokens = vllm.generate(prompts, greedy)[K.RESPONSES]
    seen = [base_tokens]
    for step in range(2):
        with torch.no_grad():  # adapters far from zero, so that the tokens change
            torch.manual_seed(step)
            for name, param in model.named_parameters():
                if ".lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.5)
        if merged:
            moved = vllm.load_weights(engine.merged_weights())
            assert moved == sum(p.numel() * 4 for _, p in base_named_weights(model))
        else:
            moved = vllm.load_adapter(engine.adapter_weights(), transport=("shm", "memory")[step])
            assert moved == sum(t.numel() * 4 for t in engine.adapter_weights().values())
        got = vllm.generate(prompts, greedy)[K.RESPONSES]
        assert torch.equal(got, merged_tokens()), step
        seen.append(got)
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    vllm.close()


@pytest.mark.slow
def test_lora_checkpoint_holds_the_adapters_and_resumes_bit_exact(ray_session, tmp_path):
    """grpo.yaml with LoRA (its ref then served by the actor's base), stopped after iteration 2
    and resumed: the metrics of iterations 3-4 equal an uninterrupted run's, bit for bit."""
    from hybridflow.controller.checkpoint import latest_checkpoint
    from hybridflow.controller.trainer import Trainer
    from checkpoint_harness import saved_state
    from test_resume import SMALL, metric_rows, non_timing

    overrides = SMALL + ["trainer.iterations=4", "trainer.save_interval=2", "trainer.val_interval=0",
                         "models.actor.train.lora.rank=8", "models.actor.train.optim.lr=0.01",
                         "trainer.save_final=true", "models.actor.train.lora.save_merged=true"]
    graph = load_graph(GRPO, overrides)
    Trainer(graph, run_dir=str(tmp_path / "full")).fit()
    Trainer(graph, run_dir=str(tmp_path / "split")).fit(stop_after=2)
    state = saved_state(latest_checkpoint(tmp_path / "split"))
    assert state["model"] and all(".lora_" in name for name in state["model"])  # adapters only
    assert {key.split(".lora_")[0] for key in state["optim"] if ".lora_" in key}
    assert not any("base_layer" in key for key in state["optim"])
    # eval takes a LoRA checkpoint: the adapters merged into the graph's actor source
    from hybridflow.cli.eval import evaluate

    at_2 = evaluate(str(GRPO), overrides, str(latest_checkpoint(tmp_path / "split")), 1, 1, 4, 1.0, "hf")
    base = evaluate(str(GRPO), overrides, None, 1, 1, 4, 1.0, "hf")
    assert at_2["summary"]["prompts"] == base["summary"]["prompts"] == 4
    assert [p["greedy"] for p in at_2["prompts"]] != [p["greedy"] for p in base["prompts"]]
    Trainer(graph, run_dir=str(tmp_path / "split"), resume=True).fit()
    full, split = metric_rows(tmp_path / "full"), metric_rows(tmp_path / "split")
    assert [r["iteration"] for r in split] == [1, 2, 3, 4]
    for a, b in zip(full, split):
        assert non_timing(a) == non_timing(b), a["iteration"]
    assert full[0]["weight_sync/bytes"] == 0.0  # the transformers rollout shares the module
    assert len({r["actor/pg_loss"] for r in full}) > 1
    # the saved actor is the adapters (peft's files), loadable on the base
    actor = tmp_path / "full" / "actor"
    assert (actor / "adapter_config.json").is_file() and (actor / "adapter_model.safetensors").is_file()
    # save_merged: beside them a plain HF model, the adapters merged into the base
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from transformers import AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(actor / "merged")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "full" / "tokenizer")
    base = build_causal_lm(graph.spec.models["actor"].source, len(tokenizer), tokenizer.pad_token_id,
                           tokenizer.eos_token_id, seed=0)
    want = PeftModel.from_pretrained(base, actor).merge_and_unload().state_dict()
    got = merged.state_dict()
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_two_iterations_of_the_smollm2_lora_graph_then_eval(tmp_path, monkeypatch):
    """The shipped LoRA graph on the packaged model, wired end to end on real Ray and vLLM: each
    sync moves the adapters' bytes only, vLLM's LoRA log-probs match the torch engine's, and
    eval merges the saved adapters into the base."""
    import json

    from safetensors.torch import load_file

    from hybridflow.cli.main import main

    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    small = ["trainer.iterations=2", "data.prompts_per_iteration=2", "models.actor.rollout.n=2",
             "data.max_response_length=16"]
    assert main(["run", "graphs/grpo_smollm2_lora.yaml", *small, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    adapters = load_file(run_dir / "actor" / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    assert adapter_bytes < 20e6  # rank 16 on every linear layer: ~4% of the 540 MB model
    assert [r["weight_sync/bytes"] for r in rows] == [float(adapter_bytes)] * 2
    assert rows[0]["actor/kl"] == 0.0  # the ref (the base) equals the actor until B moves
    assert all(r["actor/rollout_log_prob_diff_max"] < 1e-3 for r in rows)  # vLLM's LoRA = peft's
    assert all(r["memory/peak_rss_bytes"] >= r["memory/rss_bytes"] > 0 for r in rows)
    out = tmp_path / "eval.json"
    assert main(["eval", "graphs/grpo_smollm2_lora.yaml", "--actor", str(run_dir), "--limit", "4",
                 "--k", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["prompts"] == 4


def test_weight_sync_picks_the_lora_path(llama_dir):
    """Adapters by default; merged weights for vLLM under lora_sync: merged; the transformers
    rollout (which has no lora_sync) shares the module (no merged weights copied into its LoRA
    layers)."""
    from hybridflow.hybrid_engine.sync import sync_adapters, sync_merged, weight_sync
    from hybridflow.spec.engines import HFRolloutSpec, VLLMRolloutSpec

    engine, model, tokenizer = _lora_engine(llama_dir)
    chosen = {how: weight_sync(engine, VLLMRolloutSpec(engine="vllm", lora_sync=how)).func for how in ("adapter", "merged")}
    assert chosen == {"adapter": sync_adapters, "merged": sync_merged}
    assert weight_sync(engine, HFRolloutSpec()).func is sync_adapters  # lora_sync is vLLM's option
    with pytest.raises(ValueError, match="lora_sync is for rollout.engine 'vllm'"):
        HFRolloutSpec(lora_sync="merged")
    hf = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    assert weight_sync(engine, HFRolloutSpec())(hf)["weight_sync/bytes"] == 0.0
