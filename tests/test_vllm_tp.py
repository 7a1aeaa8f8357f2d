"""The vLLM rollout engine at generation TP 2 (issue 19), fed only this rank's generation shard.

Two forked gloo ranks (``megatron_harness.spawn``) each build a ``tensor_parallel_size=2``
engine through vLLM's external launcher from a tiny tied Qwen2 (every tensor random, vocabulary
128 so vLLM's partition needs no padding). Greedy tokens and rollout log-probs must equal the HF
model's (teacher-forced: argmax and log-softmax at each generated token), before a load, after
loading a different model's shards, and after loading the first model's shards back (the loaders
stay marked across reloads). Each rank's load must take exactly its shard's bytes: half of every
TP-sharded tensor plus the replicated norms.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (the .[vllm] extra) is not installed")

from megatron_harness import init_dist, spawn, stage_bytes, tiny_hf  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from hybridflow.data import keys as K  # noqa: E402
from hybridflow.engines.vllm import load_vocab_rows, check_tp_group  # noqa: E402

TG = 2
VOCAB = 128  # vLLM pads to 64 and splits evenly: 64 rows per rank, as the shards have
MAX_NEW = 6
ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
COLUMNS = ("o_proj.weight", "down_proj.weight")


def tp_shard(name: str, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Generation TP rank ``rank``'s slice of an HF tensor: the layout vLLM's loaders narrow to
    (and what ``TrainShard.to_hf(shards, tp)`` yields)."""
    if any(k in name for k in ROWS):
        return tensor.chunk(tp, 0)[rank].clone()
    if name.endswith(COLUMNS):
        return tensor.chunk(tp, 1)[rank].clone()
    return tensor.clone()


def hf_reference(model, prompts: torch.Tensor, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced greedy tokens and log-probs of ``responses`` after ``prompts`` (no padding)."""
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompts, responses], 1)).logits.float()
    logits = logits[:, prompts.shape[1] - 1 : -1]
    log_probs = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
    return logits.argmax(-1), log_probs


def _rank(rank: int, world: int, port: int) -> None:
    init_dist(rank, world, port)
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.vllm import VLLMRolloutEngine, save_for_vllm

    config = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=2)
    model_a, model_b = tiny_hf(seed=0, **config), tiny_hf(seed=1, **config)
    model_dir = save_for_vllm(model_a, None, tempfile.mkdtemp(prefix="vllm-tp-"))
    engine = VLLMRolloutEngine(
        model_dir, eos_id=1, pad_id=0, max_model_len=32, seed=0, kv_cache_bytes=16 << 20,
        tensor_parallel_size=TG, tp_ranks=[0, 1],
    )
    ids = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(7))
    prompts = TensorDict(
        {K.PROMPT_IDS: ids, K.PROMPT_MASK: torch.ones_like(ids), K.UID: torch.arange(3)}, batch_size=[3]
    )
    params = SamplingParams(n=1, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, greedy=True)

    def check(model, label: str) -> torch.Tensor:
        out = engine.generate(prompts, params)
        tokens = out[K.RESPONSES]
        assert bool(out[K.RESPONSE_MASK].all()), label
        greedy, log_probs = hf_reference(model, ids, tokens)
        assert torch.equal(tokens, greedy), (label, rank, tokens, greedy)
        err = float((out[K.ROLLOUT_LOG_PROBS] - log_probs).abs().max())
        assert err < 1e-4, (label, rank, err)
        return tokens

    tokens_a = check(model_a, "start")
    state = lambda m: [(n, t) for n, t in m.state_dict().items() if n != "lm_head.weight"]  # noqa: E731
    sharded = sum(t.numel() * 4 for n, t in state(model_b) if any(k in n for k in ROWS) or n.endswith(COLUMNS))
    replicated = sum(t.numel() * 4 for n, t in state(model_b)) - sharded
    want_bytes = sharded // TG + replicated
    # vLLM's own partition, from its shapes: the same bytes here (no vocabulary padding)
    assert engine.weight_bytes() == want_bytes, (engine.weight_bytes(), want_bytes)

    received = engine.load_weights(iter([(n, tp_shard(n, t, rank, TG)) for n, t in state(model_b)]))
    assert received == want_bytes, (received, want_bytes)
    tokens_b = check(model_b, "after loading B")
    assert not torch.equal(tokens_a, tokens_b)

    engine.load_weights(iter([(n, tp_shard(n, t, rank, TG)) for n, t in state(model_a)]))
    assert torch.equal(check(model_a, "after loading A back"), tokens_a)

    # sampling (T = 1): every TP rank draws the same tokens (the process RNGs differ), with
    # log-probs under the full vocabulary; the process's RNG state is left alone
    torch.manual_seed(100 + rank)
    before = torch.random.get_rng_state()
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW))
    assert torch.equal(torch.random.get_rng_state(), before)
    both = [torch.empty_like(out[K.RESPONSES]) for _ in range(TG)]
    torch.distributed.all_gather(both, out[K.RESPONSES])
    assert torch.equal(both[0], both[1]), both
    _, log_probs = hf_reference(model_a, ids.repeat_interleave(2, 0), out[K.RESPONSES])
    err = float((out[K.ROLLOUT_LOG_PROBS] - log_probs).abs().max())
    assert err < 1e-4, ("sampled", rank, err)
    torch.distributed.barrier()


@pytest.mark.slow
def test_vllm_tp2_fed_by_shards_matches_hf():
    # what an earlier run leaves (vLLM never unlinks its CPU communicator's files): removed at start
    for r in range(TG):
        with open(f"/dev/shm/-tp:0-[0-1]-cpushm_{r}", "wb") as f:
            f.write(b"stale")
    spawn(_rank, TG)


def test_tp_group_must_be_consecutive_ranks():
    check_tp_group([2, 3], 2)  # the second consecutive pair
    with pytest.raises(ValueError, match="rollout.layout.tp=2"):
        check_tp_group([0, 2], 2)  # training tp 4 -> tg 2: stride 2
    with pytest.raises(ValueError, match="rollout.layout.tp=2"):
        check_tp_group([1, 2], 2)  # consecutive but not one of vLLM's blocks


def test_vocab_shard_must_be_the_partition():
    param = torch.empty(64, 8)
    load_vocab_rows(param, torch.ones(64, 8))
    assert bool((param == 1).all())
    with pytest.raises(ValueError, match="vocab_size"):
        load_vocab_rows(param, torch.ones(50, 8))  # vocab 100 at tg 2: vLLM pads to 128


def _megatron_rank(rank: int, world: int, port: int, pp: int, backend: str = "gloo") -> None:
    """Megatron t = 2 (x p = ``pp``) trains model B; vLLM tg = 2 (pg = 1) starts from model A on
    each pair of consecutive ranks and takes B through the resharder (``ReshardedSync``: the
    micro-DP all-gather, then the megatron engine's own ``to_hf`` of the generation shard).

    At p = 1 the micro-DP group is one rank: nothing moves. At t = 2 x p = 2 (four ranks) the
    generation TP groups are {0, 1} and {2, 3} and the micro-DP groups {0, 2} and {1, 3}: each
    rank receives the other stage's layers of its TP half. The paper's Table 2 for t*p -> tg*pg
    gives received (t*p - tg*pg) / (tg*pg*t*p) * M = M/4 and peak M / (tg*pg) = M/2 for a model
    whose every tensor is TP-split into equal stages. Here the norms (R bytes) are replicated and
    the embedding makes stage 0 larger, so a rank of stage s receives stage 1-s's shard,
    S_{1-s}/2 + R_{1-s} (S: its split bytes), and holds both at its peak:
    (M - R)/2 + R = M/2 + R/2. Logged as the max over ranks. On ``backend="nccl"`` (one CUDA
    device per rank, ``tests/gpu``) the same checks; the HF reference stays on the CPU."""
    import copy

    init_dist(rank, world, port, backend)
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.megatron import MegatronTrainEngine
    from hybridflow.engines.vllm import VLLMRolloutEngine, save_for_vllm
    from hybridflow.hybrid_engine.sync import ReshardedSync
    from hybridflow.spec.graph import TrainEngineSpec
    from hybridflow.spec.layout import ParallelLayout

    config = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=2)
    model_a, model_b = tiny_hf(seed=0, **config), tiny_hf(seed=1, **config)
    train = ParallelLayout(tp=TG, pp=pp).resolve(world)
    engine = MegatronTrainEngine(
        copy.deepcopy(model_b), TrainEngineSpec(engine="megatron", layout=train, micro_batch_size=2)
    )
    sync = ReshardedSync(engine.train_shard(), tp=TG)
    model_dir = save_for_vllm(model_a, None, tempfile.mkdtemp(prefix="vllm-tp-"))
    pair = [rank - rank % TG + i for i in range(TG)]
    rollout = VLLMRolloutEngine(
        model_dir, eos_id=1, pad_id=0, max_model_len=32, seed=0, kv_cache_bytes=16 << 20,
        tensor_parallel_size=TG, tp_ranks=pair,
    )
    metrics = sync(rollout)
    stages = stage_bytes(model_b, pp)
    shards = [split // TG + replicated for split, replicated in stages]
    M = sum(split + replicated for split, replicated in stages)
    R = sum(replicated for _, replicated in stages)
    assert metrics["reshard/model_bytes"] == M, metrics
    assert metrics["reshard/train_shard_bytes"] == max(shards), metrics
    if pp == 1:
        assert metrics["reshard/received_bytes"] == 0, metrics
    else:  # the larger stage's shard, which the other stage's ranks receive
        assert shards[0] != shards[1] and metrics["reshard/received_bytes"] == max(shards), (metrics, shards)
    assert metrics["reshard/peak_bytes"] == M // 2 + R // 2, (metrics, M, R)
    assert metrics["reshard/redundant_bytes_received"] == 0, metrics
    # vLLM's own copy, and what it took: the whole model split tg ways, norms whole
    assert metrics["weight_sync/bytes"] == metrics["reshard/rollout_copy_bytes"] == M // 2 + R // 2, metrics

    ids = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(7))
    prompts = TensorDict(
        {K.PROMPT_IDS: ids, K.PROMPT_MASK: torch.ones_like(ids), K.UID: torch.arange(3)}, batch_size=[3]
    )
    out = rollout.generate(prompts, SamplingParams(n=1, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, greedy=True))
    responses = out[K.RESPONSES].cpu()
    greedy, log_probs = hf_reference(model_b, ids, responses)
    assert torch.equal(responses, greedy), (rank, responses, greedy)
    err = float((out[K.ROLLOUT_LOG_PROBS].cpu() - log_probs).abs().max())
    assert err < 1e-4, (rank, err)
    torch.distributed.barrier()


@pytest.mark.slow
def test_vllm_tp2_fed_by_megatron_resharder():
    pytest.importorskip("megatron.core")
    spawn(_megatron_rank, TG, 1)


@pytest.mark.slow
def test_vllm_tp2_fed_by_megatron_tp2_pp2_resharder():
    """Four ranks, t = 2 x p = 2 -> tg = 2: the micro-DP all-gather spans the stages (Table 2)."""
    pytest.importorskip("megatron.core")
    spawn(_megatron_rank, 2 * TG, 2)
