"""Shared pieces of the megatron engine tests (CPU gloo here, CUDA/nccl in tests/gpu).

Not a test module: the spawned ranks import it by name, so it must stay importable without
pytest fixtures.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from tensordict import TensorDict

from hybridflow.data import keys as K

VOCAB = 37  # odd on purpose: exercises the vocabulary padding at tp = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the forkserver imports once, before it forks the ranks: the heavy imports of the ranks.
FORKSERVER_PRELOAD = ["torch", "transformers", "megatron.core", "hybridflow.hybrid_engine.reshard", __name__]


def spawn(fn, world: int, *args, start_method: str = "forkserver") -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` processes; raises if any rank fails.

    From a forkserver, not forked from pytest: by the time these tests run, pytest's own process
    may hold a Ray driver, whose threads a fork copies in the middle of their work (4-rank runs
    aborted now and then in full suites, never alone). The forkserver is a fresh interpreter
    that imports ``FORKSERVER_PRELOAD`` once, so a rank starts in well under a second instead of
    importing megatron-core and transformers itself (10-20 s each on a loaded 2-core box).
    CUDA (nccl) runs use ``start_method="spawn"``.
    """
    start_ranks(fn, world, (free_port(), *args), start_method)


def start_ranks(fn, world: int, args: tuple, start_method: str = "forkserver") -> None:
    """``fn(rank, world, *args)`` on ``world`` processes started by ``start_method``."""
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no-op once it runs
    mp.start_processes(fn, args=(world, *args), nprocs=world, start_method=start_method)


def init_dist(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)


def tiny_hf(seed: int = 0, tied: bool = True, vocab_size: int = VOCAB, std: float = 0.1, **overrides):
    """A tiny Qwen2 with *every* tensor random (norms and q/k/v biases too), so a misplaced
    norm or bias row changes the logits. ``overrides`` are Qwen2Config fields."""
    from transformers import AutoModelForCausalLM

    from hybridflow.engines.models import tiny_qwen2_config

    config = tiny_qwen2_config(
        {"tie_word_embeddings": tied, **overrides}, vocab_size=vocab_size, pad_id=0, eos_id=1
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + 0.1 * torch.randn_like(param))
                else:
                    param.copy_(std * torch.randn_like(param))
    return model.float()


def random_batch(
    num_samples: int, prompt_len: int = 6, response_len: int = 5, seed: int = 1
) -> TensorDict:
    """Left-padded prompts, right-padded responses, positions from the masks (keys.py)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, VOCAB, (num_samples, prompt_len), generator=g)
    responses = torch.randint(2, VOCAB, (num_samples, response_len), generator=g)
    num_pad = torch.randint(0, prompt_len - 1, (num_samples,), generator=g)
    prompt_mask = (torch.arange(prompt_len)[None] >= num_pad[:, None]).long()
    num_resp = torch.randint(1, response_len + 1, (num_samples,), generator=g)
    response_mask = (torch.arange(response_len)[None] < num_resp[:, None]).long()
    prompt_ids = prompt_ids * prompt_mask
    responses = responses * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    advantages = torch.randn(num_samples, response_len, generator=g) * response_mask
    return TensorDict(
        {
            K.INPUT_IDS: torch.cat([prompt_ids, responses], 1),
            K.ATTENTION_MASK: attention_mask,
            K.POSITION_IDS: position_ids,
            K.RESPONSES: responses,
            K.RESPONSE_MASK: response_mask,
            K.ADVANTAGES: advantages,
        },
        batch_size=[num_samples],
    )


def pg_loss(mb: TensorDict, out: dict) -> tuple[torch.Tensor, dict]:
    """Token-mean policy-gradient loss with an entropy term, divided by the global token count."""
    mask = mb[K.RESPONSE_MASK].to(out["log_probs"].device)
    adv = mb[K.ADVANTAGES].to(out["log_probs"].device)
    per_token = -(out["log_probs"] * adv) - 0.01 * out["entropy"]
    loss = (per_token * mask).sum() / out["num_global_tokens"]
    return loss, {"pg": float((per_token.detach() * mask).sum() / mask.sum().clamp(min=1))}


def stage_bytes(model, pp: int) -> list[tuple[int, int]]:
    """(TP-split bytes, replicated bytes) of each pipeline stage of an HF Qwen2 as megatron holds
    it: the (tied) embedding on stage 0, layer i on stage i // (layers / pp), the final norm on
    the last stage; norms are replicated on every TP rank, every other tensor is TP-split.
    Vocabulary rows as the model has them (pass one padded as megatron pads it)."""
    per_stage = model.config.num_hidden_layers // pp
    split, replicated = [0] * pp, [0] * pp
    for name, param in model.named_parameters():  # a tied head is the embedding (listed once)
        if name.startswith("model.layers."):
            stage = int(name.split(".")[2]) // per_stage
        else:
            stage = 0 if "embed_tokens" in name else pp - 1
        if name.endswith("norm.weight"):
            replicated[stage] += param.numel() * param.element_size()
        else:
            split[stage] += param.numel() * param.element_size()
    return list(zip(split, replicated))
