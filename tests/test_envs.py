"""Environments, tools and the multi-turn rollout loop (hybridflow/envs)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hybridflow.data.tasks import TASKS
from hybridflow.envs.base import Environment, Step, env_factory
from hybridflow.envs.parsing import ChatTemplateFormat, TagFormat, ToolCall
from hybridflow.envs.product import ProductEnv
from hybridflow.envs.rollout import TurnLimits, episode_fields, episode_metrics, make_episodes, run_episodes
from hybridflow.envs.tools import ToolEnv, ToolError, calc


def test_calc_evaluates_arithmetic_only():
    assert calc("123*456") == "56088"
    assert calc("(1 + 2) * -3 // 2") == "-5"
    assert calc("7/2") == "3.5" and calc("8/2") == "4"
    assert calc("07*05") == "35" and calc("10.05+100") == "110.05" and calc("00") == "0"
    for bad in ("__import__('os').system('true')", "x", "2**1000000", "1/0", "1+", "9" * 300):
        with pytest.raises(ToolError):
            calc(bad)


def test_tag_format_parses_calls():
    named = TagFormat(open="<{tool}>", close="</{tool}>")
    assert named.parse("hm <calc>1+2</calc>", ["calc", "python"]) == ToolCall("calc", "1+2")
    assert named.stop_strings(["calc", "python"]) == ["</calc>", "</python>"]
    generic = TagFormat()
    assert generic.parse("<tool_call>calc(3*4)</tool_call>", ["calc"]) == ToolCall("calc", "3*4")
    assert generic.parse("<tool_call>nonsense</tool_call>", ["calc"]) == ToolCall("", "nonsense")
    assert generic.parse("no call here", ["calc"]) is None
    short = TagFormat(open="(", close=")", default_tool="calc")
    assert short.parse("(12*3)", ["calc"]) == ToolCall("calc", "12*3")


def test_tool_env_runs_calls_and_scores_the_answer():
    env = ToolEnv(tools=["calc"])
    env.reset({"prompt": "q", "ground_truth": "12"})
    step = env.step("<tool_call>calc(3*4)</tool_call>")
    assert step == Step("<tool_response>12</tool_response>", 0.0, False, {"tool_calls": 1, "tool_errors": 0})
    bad = env.step("<tool_call>rm(-rf)</tool_call>")
    assert bad.info["tool_errors"] == 1 and "unknown tool" in bad.observation and not bad.done
    assert env.step("12") == Step("", 1.0, True, {"success": True})


def test_python_tool_runs_in_the_sandbox():
    env = ToolEnv(tools=["python"], tool_format={"open": "<{tool}>", "close": "</{tool}>"},
                  sandbox={"cpu_seconds": 1, "wall_timeout_s": 3})
    env.reset({"ground_truth": "5"})
    assert env.step("<python>print(2 + 3)</python>").observation == "<tool_response>5\n</tool_response>"
    escaped = env.step("<python>print(open('/etc/passwd').read())</python>")
    assert escaped.info["tool_errors"] == 1 and "PermissionError" in escaped.observation


def test_product_env_shapes_rewards():
    from hybridflow.envs.product import CALL_REWARD, COPY_REWARD, OPERANDS_REWARD

    env = env_factory("product")()
    assert isinstance(env, ProductEnv)
    row = {"prompt": "12*34=", "ground_truth": "408"}
    env.reset(row)
    assert env.step("400").reward == 0.0  # no call, wrong: nothing (no partial credit for guessing)
    env.reset(row)
    right = env.step("(12*34)")
    assert right.observation == "[408]" and right.reward == pytest.approx(CALL_REWARD + OPERANDS_REWARD)
    assert env.step("(12*34)").reward == 0.0  # shaping is paid once per episode
    assert env.step("408") == Step("", 1.0, True, {"success": True})
    env.reset(row)
    env.step("(12*34)")
    # the answer is the final turn's last number: a closing tag after it changes nothing
    assert env.step("408)") == Step("", 1.0, True, {"success": True})
    env.reset(row)
    env.step("(12*34)")
    assert env.step("408 4").reward == pytest.approx(COPY_REWARD * 1 / 3)  # "4" vs "408"
    env.reset(row)
    malformed = env.step("(12*)")  # not an expression: no call reward, but 3 of 5 operand characters
    assert malformed == Step("[]", pytest.approx(OPERANDS_REWARD * 3 / 5), False, {"tool_calls": 1, "tool_errors": 1})
    env.reset(row)
    assert env.step("(12*99)").reward == pytest.approx(CALL_REWARD + OPERANDS_REWARD * 3 / 5)
    # copies 3 of the 4 digits of [1188], the answer to a call 3/5 right
    assert env.step("1180").reward == pytest.approx(COPY_REWARD * 3 / 4 * 3 / 5)
    env.reset(row)
    env.step("(7)")
    assert env.step("7").reward == 0.0  # copying the answer to a wrong question earns nothing


def test_unknown_environment_is_one_line():
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        env_factory("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        env_factory("no.such.module:Env")


# -- the rollout loop, with scripted turns --------------------------------------------------

EOS = 1


class ScriptedEnv(Environment):
    """Observation "o" * turn after each turn; done after ``turns`` steps; the step sleeps
    ``delay`` seconds; reward = turn number."""

    def __init__(self, turns=2, delay=0.0):
        self.turns, self.delay, self.count = turns, delay, 0

    def reset(self, row):
        self.delay = row.get("delay", self.delay)
        return ""

    def step(self, action_text):
        time.sleep(self.delay)
        self.count += 1
        if self.count == 3 and action_text == "boom":
            raise RuntimeError("env bug")
        return Step("o" * self.count, float(self.count), self.count >= self.turns, {"tool_calls": 1})


def _scripted_generate(calls):
    """Each turn: tokens 10, 11, EOS with log-probs -1, -2, -3 (recorded per call)."""

    def generate(contexts, budgets):
        calls.append(len(contexts))
        return [([10, 11, EOS][:b], [-1.0, -2.0, -3.0][:b], b >= 3) for b in budgets]

    return generate


def _run(envs, limits, overlap=True, rows=None):
    calls = []
    episodes = make_episodes([[5, 6]] * len(envs), rows or [{}] * len(envs), iter(envs).__next__)
    run_episodes(episodes, _scripted_generate(calls), lambda ids: "x", lambda s: [20] * len(s), limits, overlap=overlap)
    return episodes, calls


def test_episode_tokens_masks_and_rewards():
    (episode,), _ = _run([ScriptedEnv(turns=2)], TurnLimits(max_turns=4, max_response_tokens=32, eos_id=EOS))
    # turn 1 (3 model tokens), obs "o" (1), turn 2 (3), done
    assert episode.response == [10, 11, EOS, 20, 10, 11, EOS]
    assert episode.model_mask == [1, 1, 1, 0, 1, 1, 1]
    assert episode.seen == [[5, 6], [5, 6, 10, 11, EOS, 20]]  # each turn saw all before it
    assert episode.step_rewards == [(2, 1.0), (6, 2.0)] and episode.score == 3.0
    assert episode.turns == 2 and episode.done and not episode.truncated

    fields = episode_fields([episode], torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), 10, 0)
    assert fields["response_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 1, 0, 0, 0]]
    assert fields["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]]
    assert fields["position_ids"][0, 1:10].tolist() == list(range(9))
    assert fields["rollout_log_probs"].tolist() == [[-1, -2, -3, 0, -1, -2, -3, 0, 0, 0]]
    assert fields["token_rewards"][0].tolist() == [0, 0, 1, 0, 0, 0, 2, 0, 0, 0]
    assert fields["scores"].tolist() == [3.0]


def test_max_turns_and_token_budget_end_episodes_truncated():
    (by_turns,), _ = _run([ScriptedEnv(turns=9)], TurnLimits(max_turns=2, max_response_tokens=64, eos_id=EOS))
    assert by_turns.turns == 2 and by_turns.truncated
    (by_budget,), _ = _run([ScriptedEnv(turns=9)], TurnLimits(max_turns=9, max_response_tokens=9, eos_id=EOS))
    assert len(by_budget.response) <= 9 and by_budget.truncated
    metrics = episode_metrics([by_turns, by_budget])
    assert metrics["response/truncated_frac"] == 1.0 and metrics["rollout/turns_mean"] == 2.0


def test_an_environment_that_raises_ends_only_its_episode():
    class Boom(ScriptedEnv):
        def step(self, action_text):
            raise RuntimeError("env bug")

    (bad, good), _ = _run([Boom(), ScriptedEnv(turns=2)], TurnLimits(4, 32, EOS))
    assert bad.done and bad.tool_errors == 1 and bad.score == 0.0
    assert good.done and good.score == 3.0


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_lets_fast_episodes_run_ahead(overlap):
    # One slow episode (0.3 s steps) and three fast ones, three turns each.
    envs = [ScriptedEnv(turns=3, delay=0.3)] + [ScriptedEnv(turns=3, delay=0.0) for _ in range(3)]
    start = time.monotonic()
    episodes, calls = _run(envs, TurnLimits(3, 64, EOS), overlap=overlap)
    assert all(e.done and e.turns == 3 for e in episodes)
    if overlap:
        # the fast episodes took their turns 2 and 3 while the slow one's step ran
        assert calls[0] == 4 and calls[-2:] == [1, 1] and sum(calls) == 12, calls
    else:
        assert calls == [4, 4, 4], calls  # every round waits for the slowest step
    assert time.monotonic() - start < 3


# -- token in, token out with the real transformers engine ---------------------------------

# A ChatML-like template that is NOT append-only: earlier assistant turns lose their
# <think>...</think> part (as reasoning models' templates do).
THINK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and not loop.last %}"
    "<|im_start|>assistant\n{{ m.content.split('</think>')[-1] }}<eos>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<eos>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    from hybridflow.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789<>|_/{}\":,*+ \n")
    tokenizer.chat_template = THINK_TEMPLATE
    return tokenizer


class ChatCalcEnv(Environment):
    """Answers every turn with calc's result of the digits in it, rendered by the chat template."""

    def __init__(self, tokenizer):
        self.format = ChatTemplateFormat(tokenizer)

    def reset(self, row):
        return ""

    def step(self, action_text):
        call = self.format.parse(action_text, ["calc"])
        return Step(self.format.render_result(calc(call.argument) if call else "none"), 0.0, False)


def test_chat_template_observation_is_a_delta(chat_tokenizer):
    obs = ChatTemplateFormat(chat_tokenizer).render_result("42")
    assert obs == "\n<|im_start|>tool\n42<eos>\n<|im_start|>assistant\n"


def test_tokens_in_tokens_out_with_a_template_that_rewrites_history(chat_tokenizer):
    """Every turn the engine is given exactly prompt + its own earlier tokens + observation
    tokens; re-rendering the same conversation through the template would differ."""
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.hf_rollout import HFRolloutEngine
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.spec.graph import ModelSource

    tok = chat_tokenizer
    torch.manual_seed(0)
    model = build_causal_lm(ModelSource(config={"hidden_size": 32, "num_hidden_layers": 1}), len(tok),
                            tok.pad_token_id, tok.eos_token_id, seed=0)
    engine = HFRolloutEngine.build(model, tok, max_model_len=256, max_num_seqs=4, seed=0)
    params = SamplingParams(temperature=1.0)
    seen_by_engine = []
    # The model's first turn is forced (a thought, then a tool call, then EOS); later turns are sampled.
    forced = tok.encode('<think>abc</think><tool_call>{"name": "calc", "arguments": "6*7"}</tool_call>',
                        add_special_tokens=False) + [tok.eos_token_id]

    def generate(contexts, budgets):
        seen_by_engine.extend(list(c) for c in contexts)
        out = engine.generate_turns(contexts, budgets, params, [])
        return [(forced, [0.0] * len(forced), True) if len(c) == len(prompt) else o for c, o in zip(contexts, out)]

    prompt = tok.apply_chat_template([{"role": "user", "content": "six times seven"}], add_generation_prompt=True, return_dict=False)
    (episode,) = make_episodes([prompt], [{}], lambda: ChatCalcEnv(tok))
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    run_episodes([episode], generate, lambda ids: tok.decode(ids, skip_special_tokens=True), encode,
                 TurnLimits(max_turns=3, max_response_tokens=160, eos_id=tok.eos_token_id))

    assert len(seen_by_engine) >= 2
    # Rebuild each turn's context from the pieces: the model's own tokens and the observations.
    pieces, start = [], 0
    mask = episode.model_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            pieces.append(episode.response[start:i])
            start = i
    assert pieces[0] == forced
    obs = encode(ChatTemplateFormat(tok).render_result("42"))
    assert pieces[1] == obs
    for turn, context in enumerate(seen_by_engine):
        assert context == prompt + sum(pieces[: 2 * turn], []), f"turn {turn} saw re-tokenised history"
    # A loop that re-rendered the conversation would have fed the model something else.
    messages = [{"role": "user", "content": "six times seven"},
                {"role": "assistant", "content": tok.decode(forced, skip_special_tokens=True)},
                {"role": "tool", "content": "42"}]
    rerendered = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert rerendered != seen_by_engine[1]
    assert "<think>" in tok.decode(seen_by_engine[1]) and "<think>" not in tok.decode(rerendered)

    # The rollout log-probs of the sampled turns are the training forward's, on model tokens only.
    width = 160
    prompt_ids = torch.tensor([prompt])
    fields = episode_fields([episode], prompt_ids, torch.ones_like(prompt_ids), width, tok.pad_token_id)
    logits = model(input_ids=fields["input_ids"], attention_mask=fields["attention_mask"],
                   position_ids=fields["position_ids"]).logits[:, -width - 1:-1]
    log_probs = torch.log_softmax(logits.float(), -1).gather(-1, fields["responses"][..., None])[..., 0]
    sampled = fields["response_mask"].clone()
    sampled[0, : len(forced)] = 0  # the forced turn has no rollout log-probs
    assert sampled.sum() > 0
    diff = ((log_probs - fields["rollout_log_probs"]) * sampled).abs().max()
    assert diff < 1e-4, diff


# -- the shipped graph, end to end -----------------------------------------------------------


@pytest.mark.slow
def test_grpo_tool_graph_runs_and_logs_tool_metrics(ray_session, tmp_path):
    import json
    import math
    from pathlib import Path

    from hybridflow.controller.trainer import Trainer
    from hybridflow.graph.dag import load_graph

    graph_file = Path(__file__).resolve().parent.parent / "graphs" / "grpo_tool.yaml"
    graph = load_graph(graph_file, [
        "trainer.iterations=3", "trainer.val_interval=3", "trainer.progress=false",
        "data.prompts_per_iteration=4", "data.num_val=4", "models.actor.rollout.n=4",
    ])
    summary = Trainer(graph, run_dir=str(tmp_path / "run")).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["iterations"] == 3 and len(rows) == 3
    for key in ("tool/calls_per_sample", "tool/errors", "rollout/turns_mean", "env/success", "reward/mean"):
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    assert rows[-1]["rollout/turns_mean"] >= 1.0
    # every episode carries the weight version it was generated with: this iteration's (sync)
    assert all(r["async/staleness_max"] == 0.0 for r in rows)
    assert "val/env/success" in rows[-1]  # validation runs the multi-turn node greedily
    # training saw the observation tokens in context and agreed with the rollout's log-probs
    assert rows[-1]["actor/rollout_log_prob_diff_max"] < 1e-3
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all("reward" in s for s in samples)


@pytest.mark.slow
def test_vllm_multi_turn_matches_the_training_forward():
    """vLLM (in-process, its own interpreter) runs product episodes through generate_turns: its
    log-probs on the model's tokens equal a training-style forward over the whole episode
    (observation tokens in context), and tool turns happen."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("vllm", reason="vllm (the .[vllm] extra) is not installed")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "tests" / "vllm_multi_turn_probe.py")], cwd=root,
                          capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["diff_max"] < 1e-4, result["diff_max"]
    assert result["tool_calls"] >= 1 and any(0 in mask for mask in result["model_masks"])
    assert all(1 <= t <= 3 for t in result["turns"])


def test_tool_env_in_the_chat_template_format(chat_tokenizer):
    env = ToolEnv(tools=["calc"], tool_format="chat")
    env.use_tokenizer(chat_tokenizer)
    env.reset({"ground_truth": "42"})
    assert env.stop_strings() == []  # a chat turn ends at EOS
    step = env.step('<think>hm</think><tool_call>{"name": "calc", "arguments": "6*7"}</tool_call>')
    assert step.observation == "\n<|im_start|>tool\n42<eos>\n<|im_start|>assistant\n"
    assert step.info == {"tool_calls": 1, "tool_errors": 0}
    assert env.step("42").reward == 1.0
    with pytest.raises(ValueError, match="tool_format 'xml'"):
        ToolEnv(tool_format="xml")


def test_product_env_in_the_chat_template_format(chat_tokenizer):
    """The product task for a chat model: the question is found in the user's message, the
    calculator's answer is read from the tool message the template renders, and errors show
    their message (the tag format's tiny alphabet shows none)."""
    from hybridflow.envs.product import CALL_REWARD, COPY_REWARD, OPERANDS_REWARD

    env = env_factory("product", {"tool_format": "chat"})()
    env.use_tokenizer(chat_tokenizer)
    row = {"prompt": [{"role": "user", "content": "what is 12*34?"}], "ground_truth": "408"}
    env.reset(row)
    step = env.step('<tool_call>{"name": "calc", "arguments": "12*34"}</tool_call>')
    assert step.observation == "\n<|im_start|>tool\n408<eos>\n<|im_start|>assistant\n"
    assert step.reward == pytest.approx(CALL_REWARD + OPERANDS_REWARD)
    assert env.step("it is 407").reward == pytest.approx(COPY_REWARD * 2 / 3)  # copy of "408"
    env.reset({"prompt": "12*34=", "ground_truth": "408"})  # a string prompt: the same question
    bad = env.step('<tool_call>{"name": "calc", "arguments": "12*"}</tool_call>')
    assert "error: not an expression" in bad.observation
    assert bad.reward == pytest.approx(OPERANDS_REWARD * 3 / 5)


def test_env_rows_carry_the_row_fields():
    from tensordict import TensorDict

    from hybridflow.data import keys as K
    from hybridflow.envs.rollout import env_rows

    batch = TensorDict({K.PROMPT_IDS: torch.zeros(2, 3)}, batch_size=[2])
    batch[K.PROMPT_TEXT] = ["a=", "b="]
    batch[K.GROUND_TRUTH] = ["1", "2"]
    batch[K.EXTRA_INFO] = ['{"k": 1}', "null"]
    rows = env_rows(batch)
    assert rows == [
        {"prompt": "a=", "ground_truth": "1", "data_source": "", "extra_info": {"k": 1}},
        {"prompt": "b=", "ground_truth": "2", "data_source": "", "extra_info": None},
    ]


def test_a_hanging_environment_step_times_out_and_the_rest_go_on():
    class Hangs(ScriptedEnv):
        def step(self, action_text):
            threading.Event().wait(3)  # far beyond the timeout (and the thread still ends soon)
            return super().step(action_text)

    start = time.monotonic()
    (hung, good), _ = _run([Hangs(), ScriptedEnv(turns=2)], TurnLimits(4, 32, EOS, step_timeout_s=0.5))
    assert time.monotonic() - start < 5
    assert hung.done and hung.tool_errors == 1 and hung.score == 0.0
    assert good.done and good.score == 3.0


@pytest.mark.parametrize(("override", "field", "words"), [
    ("nodes.generate.options.env=nope", "nodes[0].options.env", "unknown environment 'nope'"),
    ("nodes.generate.options.env=no.such:Env", "nodes[0].options.env", "cannot be imported"),
    ("nodes.generate.options.env_kwargs={tools: [sql]}", "nodes[0].options.env_kwargs", "unknown tools ['sql']"),
])
def test_bad_environment_is_one_line_before_the_run(override, field, words):
    from pathlib import Path

    from hybridflow.controller.preflight import check_environments
    from hybridflow.graph.dag import load_graph
    from hybridflow.spec.loading import SpecError

    graph = load_graph(Path(__file__).resolve().parent.parent / "graphs" / "grpo_tool.yaml", [override])
    with pytest.raises(SpecError) as info:
        check_environments(graph, TASKS["product"].tokenizer())
    message = str(info.value)
    assert "grpo_tool.yaml" in message and field in message and words in message and "\n" not in message


def test_vllm_turn_ends_at_the_token_that_completes_a_stop_string(chat_tokenizer):
    """vLLM runs without a tokenizer, so a multi-token stop string is found after the turn: the
    turn keeps exactly the tokens up to the one that completes the first stop string."""
    from types import SimpleNamespace

    from hybridflow.engines.vllm import VLLMRolloutEngine

    tok = chat_tokenizer
    engine = SimpleNamespace(tokenizer=tok)
    text = "a<calc>12*34</calc>b</calc>c"
    ids = tok.encode(text, add_special_tokens=False)
    stop_end = VLLMRolloutEngine._stop_end
    for stop, want in ((["</calc>"], "a<calc>12*34</calc>"), (["*3", "</calc>"], "a<calc>12*3"),
                       (["c"], "a<c"), (["a"], "a")):
        end = stop_end(engine, ids, stop)
        assert tok.decode(ids[:end]) == want, stop
    assert stop_end(engine, ids, ["</tool_call>"]) is None and stop_end(engine, ids, []) is None
