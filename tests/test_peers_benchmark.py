"""benchmarks/peers.py without TRL: both sides start from the same weights; workload flags; JSON.

The initial weights: hybridflow's workers build the actor from ``source: {config: ...}`` with
``trainer.seed`` (``build_causal_lm``, inside a forked RNG); peers.py's TRL side seeds torch and
instantiates ``Qwen2ForCausalLM(config)``. They must be equal, bit for bit, or the comparison
starts from two different policies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.data.tasks import get_task
from hybridflow.engines.models import build_causal_lm

ROOT = Path(__file__).resolve().parent.parent


def _peers():
    spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "flags, seed",
    [([], 0), (["--hidden-size", "64", "--layers", "2", "--intermediate-size", "96", "--heads", "2",
                "--kv-heads", "1"], 7)],
)
def test_initial_weights_equal_trl_side(flags, seed):
    peers = _peers()
    args = peers.parse_args(flags)
    graph = peers.peers_graph(args, seed)
    actor = graph.spec.models["actor"]
    tokenizer = get_task(peers.TASK).tokenizer()
    ours = build_causal_lm(actor.source, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id,
                           seed=graph.spec.trainer.seed, dtype=actor.train.dtype)
    theirs = peers.trl_model(peers.model_config(args), tokenizer, seed)
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert ours.config.hidden_size == args.hidden_size and ours.config.num_key_value_heads == args.kv_heads
    # Another seed gives other weights: the comparison above can fail.
    other = peers.trl_model(peers.model_config(args), tokenizer, seed + 1)
    assert not torch.equal(other.model.embed_tokens.weight, theirs.model.embed_tokens.weight)


def test_workload_flags_reach_the_graph():
    peers = _peers()
    args = peers.parse_args(["--hidden-size", "128", "--layers", "3", "--intermediate-size", "256", "--heads", "4",
                             "--kv-heads", "2", "--prompts", "6", "--samples", "5", "--max-new-tokens", "12",
                             "--lr", "3e-4", "--engine", "vllm", "--iterations", "20", "--seeds", "1", "2"])
    spec = peers.peers_graph(args, 2).spec
    actor = spec.models["actor"]
    assert actor.source.config == {"hidden_size": 128, "num_hidden_layers": 3, "intermediate_size": 256,
                                   "num_attention_heads": 4, "num_key_value_heads": 2}
    assert (actor.rollout.n, actor.rollout.engine, actor.train.optim.lr) == (5, "vllm", 3e-4)
    assert (spec.data.prompts_per_iteration, spec.data.max_response_length) == (6, 12)
    assert spec.trainer.seed == spec.data.seed == 2 and args.seeds == [1, 2]
    assert actor.train.compute_dtype == "float32"
    bf16 = peers.peers_graph(peers.parse_args(["--bf16"]), 0).spec.models["actor"]
    assert (bf16.train.compute_dtype, bf16.train.dtype) == ("bfloat16", "float32")
    advantage = next(n for n in spec.nodes if n.op == "advantage").options
    assert advantage.epsilon == peers.TRL_STD_EPSILON == 1e-4
    defaults = peers.parse_args([])
    assert (defaults.hidden_size, defaults.layers, defaults.prompts, defaults.samples,
            defaults.max_new_tokens, defaults.lr, defaults.iterations) == (256, 4, 16, 8, 64, 1e-3, 50)
    with pytest.raises(SystemExit):
        peers.parse_args(["--hidden-size", "100", "--heads", "3"])


def test_a_long_answer_gets_a_position_table_that_holds_it():
    peers = _peers()
    assert "max_position_embeddings" not in peers.model_config(peers.parse_args([]))  # 8 + 64 tokens
    args = peers.parse_args(["--max-new-tokens", "128"])
    assert peers.model_config(args)["max_position_embeddings"] == 192
    graph = peers.peers_graph(args, 0)
    assert graph.spec.models["actor"].source.config["max_position_embeddings"] == 192


def test_an_odd_prompt_count_runs_on_one_rank():
    """Each rank takes whole prompt groups: an odd --prompts runs hybridflow on one rank of both
    threads (its graph then validates) unless --ranks 2 is asked for, which is refused."""
    peers = _peers()
    assert peers.parse_args(["--prompts", "6"]).ranks == 2
    odd = peers.parse_args(["--prompts", "7", "--samples", "6"])
    assert odd.ranks == 1
    spec = peers.peers_graph(odd, 0).spec  # validates: 7 prompts over one rank
    assert spec.data.prompts_per_iteration == 7
    with pytest.raises(SystemExit):
        peers.parse_args(["--prompts", "7", "--ranks", "2"])


def test_micro_batches_reach_both_sides():
    """hybridflow's tiny graph micro-batches by tokens (--micro-batch-tokens); TRL's forward and
    backward run a divisor of the batch at a time (gradient accumulation over the rest, one
    generation per optimizer step): the samples of padded width within --trl-micro-batch-tokens,
    or --trl-micro-batch samples."""
    peers = _peers()
    train = peers.peers_graph(peers.parse_args([]), 0).spec.models["actor"].train
    assert (train.micro_batch_tokens, train.remove_padding) == (1024, True)
    flags = peers.parse_args(["--micro-batch-tokens", "512", "--trl-micro-batch", "32"])
    assert peers.peers_graph(flags, 0).spec.models["actor"].train.micro_batch_tokens == 512
    def samples(*argv):
        return peers.trl_micro_batch(peers.parse_args(list(argv)))

    # 4096 tokens of 8 prompt + 64 new columns: 56 samples at most, of a batch of 16 x 8.
    assert samples() == 32
    assert samples("--max-new-tokens", "7", "--prompts", "64", "--samples", "16") == 256  # 273 fit
    assert samples("--prompts", "12", "--max-new-tokens", "40") == 48  # of 96; 85 fit
    assert samples("--trl-micro-batch-tokens", "10") == 1
    assert samples("--model", "smollm2") == 32  # 4 x 8 samples of 96 + 32 columns: the whole batch
    assert samples("--trl-micro-batch", "64", "--prompts", "12") == 48 and samples("--trl-micro-batch", "7") == 4
    summary = peers.summarise(flags, [_fake_run()], (0.0,) * 3, (0.0,) * 3)
    assert (summary["trl_micro_batch"], summary["hybridflow_micro_batch_tokens"]) == (32, 512)


def test_summary_keeps_the_keys_and_adds_curves():
    peers = _peers()
    args = peers.parse_args(["--iterations", "12", "--seeds", "0", "1", "--warmup", "2"])
    runs = []
    for offset in (0.0, 0.1):
        rewards = [offset + i / 20 for i in range(12)]
        runs.append(SimpleNamespace(
            trl_times=[1.0] * 12, trl_rewards=rewards, trl_tokens=[100] * 12, trl_unfinished=[0.5] * 12,
            hf_times=[0.5] * 12, hf_rewards=rewards, hf_tokens=[50] * 12, hf_unfinished=[0.25] * 12,
            trl_stages=[{"_prepare_inputs": 0.6, "transformers.generate": 0.5, "compute_loss": 0.1}] * 12,
            hf_stages=[{"generate": 0.2, "weight_sync": 0.05, "reward": 0.21, "update_actor": 0.1 + offset}] * 12,
        ))
    result = peers.summarise(args, runs, (1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    for key in ("ratio_hybridflow_over_trl", "hybridflow_reward_last10", "trl_reward_last10",
                "hybridflow_tokens_per_iter", "trl_tokens_per_iter"):
        assert key in result
    assert result["ratio_hybridflow_over_trl"] == pytest.approx(0.5)
    assert result["trl_s_per_token"] == pytest.approx(0.01) and result["hybridflow_s_per_token"] == pytest.approx(0.01)
    assert result["hybridflow_reward_last10"] == pytest.approx(sum(i / 20 for i in range(2, 12)) / 10 + 0.05)
    assert result["per_seed"][1]["hybridflow"]["curves"]["reward"] == runs[1].hf_rewards
    assert result["workload"]["hidden_size"] == 256 and result["load_average_after"][0] == 2.0
    # Stages: means over seeds; "other" is the iteration outside the top-level stages (nested
    # ones, generation inside TRL's _prepare_inputs or weight sync inside generate, and reward,
    # which overlaps generate, not subtracted).
    assert result["trl_stages_s"]["transformers.generate"] == pytest.approx(0.5)
    assert result["trl_stages_s"]["other"] == pytest.approx(1.0 - 0.6 - 0.1)
    assert result["hybridflow_stages_s"]["update_actor"] == pytest.approx(0.15)
    assert result["hybridflow_stages_s"]["other"] == pytest.approx(0.5 - 0.2 - 0.15)
    assert "ratio_limit_over_trl" not in result and "limit_iter_s" not in result  # --no-limit


def test_summary_ratios_are_means_over_seeds_with_the_limit_beside():
    """With the limit's plain loop timed too, the JSON keeps ratio_hybridflow_over_trl and adds
    ratio_limit_over_trl and ratio_hybridflow_over_limit, each the mean of the seeds' ratios."""
    peers = _peers()
    args = peers.parse_args(["--iterations", "12", "--seeds", "0", "1", "--warmup", "2"])
    runs = []
    for trl_s, hf_s, limit_s in ((1.0, 0.5, 0.4), (2.0, 0.5, 0.5)):
        runs.append(SimpleNamespace(
            trl_times=[trl_s] * 12, trl_rewards=[0.1] * 12, trl_tokens=[100] * 12, trl_unfinished=[0.5] * 12,
            hf_times=[hf_s] * 12, hf_rewards=[0.2] * 12, hf_tokens=[50] * 12, hf_unfinished=[0.25] * 12,
            limit_times=[limit_s] * 12, limit_rewards=[0.3] * 12, limit_tokens=[60] * 12,
            limit_unfinished=[0.0] * 12,
            limit_stages=[{"generate": 0.1, "reward": 0.01, "advantage": 0.01, "update_actor": 0.2}] * 12,
        ))
    result = peers.summarise(args, runs, (1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    assert result["ratio_hybridflow_over_trl"] == pytest.approx((0.5 + 0.25) / 2)  # not 0.5 / 1.5
    assert result["ratio_limit_over_trl"] == pytest.approx((0.4 + 0.25) / 2)
    assert result["ratio_hybridflow_over_limit"] == pytest.approx((1.25 + 1.0) / 2)
    assert result["per_seed"][0]["ratio_limit_over_trl"] == pytest.approx(0.4)
    assert result["limit_reward_last10"] == pytest.approx(0.3) and result["limit_tokens_per_iter"] == 60
    assert result["limit_stages_s"]["other"] == pytest.approx(0.45 - 0.1 - 0.2)
    peers.print_tables(result)  # the limit's row and ratios print


def test_fixed_length_reaches_both_sides():
    peers = _peers()
    args = peers.parse_args(["--fixed-length", "--max-new-tokens", "12"])
    spec = peers.peers_graph(args, 0).spec
    assert spec.models["actor"].rollout.fixed_length and spec.data.max_response_length == 12
    score = next(n for n in spec.nodes if n.op == "score").options
    assert score.unfinished == "keep"  # no response ends: the ending rule would zero every score
    assert peers.trl_generation_kwargs(args) == {"min_new_tokens": 12}
    default = peers.parse_args([])
    assert not peers.peers_graph(default, 0).spec.models["actor"].rollout.fixed_length
    assert peers.trl_generation_kwargs(default) is None
    assert peers.summarise(args, [_fake_run()], (0.0,) * 3, (0.0,) * 3)["workload"]["fixed_length"] is True

    # TRL's reward keeps the task's score of a completion that never ended.
    task = get_task(peers.TASK)
    tokenizer = task.tokenizer()
    prompt = task.make_prompts(1, 0)[0]
    truth = prompt["ground_truth"]
    ids = tokenizer(truth)["input_ids"]  # the right answer, without EOS
    with_rule, unfinished = peers.trl_scores(task, tokenizer, [prompt["prompt"]], [truth], [truth], [ids])
    without, _ = peers.trl_scores(task, tokenizer, [prompt["prompt"]], [truth], [truth], [ids], ending=False)
    assert bool(unfinished[0]) and with_rule[0] == 0 and without[0] > 0


def _fake_run():
    n = 12
    return SimpleNamespace(
        trl_times=[1.0] * n, trl_rewards=[0.0] * n, trl_tokens=[1] * n, trl_unfinished=[1.0] * n,
        hf_times=[1.0] * n, hf_rewards=[0.0] * n, hf_tokens=[1] * n, hf_unfinished=[1.0] * n,
    )


def test_fixed_length_sampling_fills_every_response():
    """The transformers rollout with min_new_tokens = max_new_tokens: no sample ends early, while
    the same model and seed without it ends some (so the check can fail)."""
    from hybridflow.data import keys as K
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.hf_rollout import HFRolloutEngine
    from hybridflow.spec.graph import ModelSource

    tokenizer = get_task("copy").tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = build_causal_lm(ModelSource(config={}), len(tokenizer), pad, eos, seed=3)
    prompts = _peers_prompts(tokenizer)
    lengths = {}
    for fixed in (0, 10):
        torch.manual_seed(0)
        engine = HFRolloutEngine(model, eos_id=eos, pad_id=pad)
        out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=10, temperature=2.0, min_new_tokens=fixed))
        lengths[fixed] = out[K.RESPONSE_MASK].sum(-1)
        if fixed:
            assert bool(out[K.TRUNCATED].all()) and not bool((out[K.RESPONSES] == eos).any())
            assert bool((out[K.ROLLOUT_LOG_PROBS] < 0).all())  # every token has its log-prob
    assert int(lengths[0].min()) < 10
    assert bool((lengths[10] == 10).all())


def _peers_prompts(tokenizer):
    from tensordict import NonTensorStack, TensorDict

    from hybridflow.data import keys as K

    enc = tokenizer(["ab", "cde", "f"], padding=True, return_tensors="pt")
    return TensorDict(
        {K.PROMPT_IDS: enc["input_ids"], K.PROMPT_MASK: enc["attention_mask"], K.UID: torch.arange(3),
         K.PROMPT_TEXT: NonTensorStack("ab", "cde", "f"), K.GROUND_TRUTH: NonTensorStack("", "", "")},
        batch_size=[3],
    )


@pytest.mark.slow  # Ray workers, and vLLM's start on CPU
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_fixed_length_hybridflow_iteration(engine, tmp_path):
    """One real iteration of peers.py's hybridflow side with --fixed-length: every sample is
    max-new-tokens long (none ended), and the rewards are the task's, not zeroed."""
    peers = _peers()
    # 192 tokens of a random model over 12 symbols: without fixed length some would be EOS.
    args = peers.parse_args(["--fixed-length", "--engine", engine, "--prompts", "2", "--samples", "4",
                             "--max-new-tokens", "24", "--hidden-size", "64", "--layers", "1",
                             "--intermediate-size", "96", "--heads", "2", "--kv-heads", "1"])
    trainer = peers.hybridflow_trainer(tmp_path / "run", args, 0)
    try:
        metrics = trainer.step(1)
    finally:
        trainer.shutdown()
    assert metrics["rollout/num_tokens"] == 2 * 4 * 24
    assert metrics["reward/unfinished_frac"] == 1.0


def test_vllm_compile_reaches_the_graph():
    """The tiny workload's vLLM compiles by default, SmolLM2's runs eagerly; the flag sets either,
    and the JSON says which ran."""
    peers = _peers()

    def eager(*flags: str) -> bool:
        spec = peers.peers_graph(peers.parse_args(["--engine", "vllm", *flags]), 0).spec
        return spec.models["actor"].rollout.enforce_eager

    assert not eager() and eager("--vllm-compile", "off")
    assert eager("--model", "smollm2") and not eager("--model", "smollm2", "--vllm-compile", "on")
    args = peers.parse_args(["--engine", "vllm", "--vllm-compile", "off"])
    assert peers.summarise(args, [_fake_run()], (0.0,) * 3, (0.0,) * 3)["hybridflow_vllm_compile"] == "off"
    with pytest.raises(SystemExit):
        peers.parse_args(["--vllm-compile", "yes"])


def test_smollm2_flags_reach_the_graph():
    peers = _peers()
    args = peers.parse_args(["--model", "smollm2", "--seeds", "0", "1", "2", "--trl-engine", "vllm"])
    assert (args.prompts, args.samples, args.max_new_tokens, args.lr, args.temperature) == (4, 8, 32, 3e-5, 0.7)
    assert args.trl_engine == "vllm" and args.hidden_size is None
    spec = peers.peers_graph(args, 1).spec
    actor = spec.models["actor"]
    assert actor.source.package == peers.SMOLLM2 and actor.train.share_prompts
    assert (actor.rollout.n, actor.rollout.temperature, actor.train.optim.lr) == (8, 0.7, 3e-5)
    assert spec.data.source == "builtin:arith_words" and spec.data.system_prompt == peers.SMOLLM2_SYSTEM_PROMPT
    assert (spec.data.prompts_per_iteration, spec.data.max_response_length, spec.data.seed) == (4, 32, 1)
    score = next(n for n in spec.nodes if n.op == "score").options
    assert score.unfinished == "keep"
    # The tiny model's shape flags mean nothing for SmolLM2: refused, not ignored.
    with pytest.raises(SystemExit):
        peers.parse_args(["--model", "smollm2", "--hidden-size", "128"])


def test_ranks_choose_hybridflow_pool(tmp_path):
    import yaml

    peers = _peers()
    assert peers.pool_file(peers.parse_args([])) == str(ROOT / "resource_pools/local_cpu.yaml")
    one = yaml.safe_load(Path(peers.pool_file(peers.parse_args(["--ranks", "1"]))).read_text())["pools"]["default"]
    assert (one["devices_per_node"], one["threads_per_device"]) == (1, 2)
    graph = peers.peers_graph(peers.parse_args(["--ranks", "1"]), 0)
    assert graph.pools["default"].num_devices == 1
