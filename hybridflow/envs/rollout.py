"""Multi-turn rollouts: model turns and environment steps, token in, token out.

Each sample is an episode. Its context is a list of token ids that only ever grows: the prompt,
then each model turn's sampled tokens exactly as sampled, then each observation's tokens
(``tokenize(observation)``, appended once). Nothing already in the context is decoded and
re-encoded, so the model is trained on exactly the tokens it saw and wrote, whatever the chat
template would render for the same conversation.

One episode: ``reset`` -> [model turn -> ``env.step(turn text)`` -> observation tokens]* until
the environment says ``done``, ``max_turns`` model turns were taken, or the response budget
(``max_response_tokens``, model and observation tokens together) is spent (``truncated``).

Scheduling (``overlap``): every model turn is one ``generate`` call over the episodes ready for
it; environment steps run in a thread pool. With ``overlap`` an episode whose step has returned
joins the next ``generate`` call at once, while slower steps of other episodes still run; in
lock-step mode each round waits for every episode's step before the next ``generate``.

The batch fields (``episode_fields``) put each response as model and observation tokens side by
side: ``response_mask`` is 1 on the model's tokens only (observations are not trained on, nor
compared in the rollout-vs-training log-prob check), ``attention_mask`` is 1 on both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.data import keys as K
from hybridflow.data.batch import sequence_fields
from hybridflow.envs.base import Environment, Step

# generate(contexts, max_new_tokens per context) -> per context (new tokens, their log-probs,
# whether the turn ended by itself: EOS or a stop string, not the token limit)
GenerateFn = Callable[[list[list[int]], list[int]], list[tuple[list[int], list[float], bool]]]


GATHER_S = 0.005  # after the first step returns, how long to wait for others to batch with it


@dataclass
class Episode:
    prompt_ids: list[int]
    env: Environment
    row: dict[str, Any] = field(default_factory=dict)  # what env.reset gets
    response: list[int] = field(default_factory=list)  # model and observation tokens
    model_mask: list[int] = field(default_factory=list)  # 1 on the model's tokens
    log_probs: list[float] = field(default_factory=list)  # 0.0 on observation tokens
    step_rewards: list[tuple[int, float]] = field(default_factory=list)  # (response position, reward)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    success: bool = False
    done: bool = False
    truncated: bool = False
    seen: list[list[int]] = field(default_factory=list)  # the context each turn was generated from

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response

    @property
    def score(self) -> float:
        return sum(r for _, r in self.step_rewards)

    def append(self, tokens: list[int], log_probs: list[float] | None = None) -> None:
        model = log_probs is not None
        self.response += tokens
        self.model_mask += [int(model)] * len(tokens)
        self.log_probs += log_probs if model else [0.0] * len(tokens)


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_response_tokens: int
    eos_id: int
    step_timeout_s: float = math.inf  # a slower environment step ends its episode (an error)


def run_episodes(
    episodes: list[Episode],
    generate: GenerateFn,
    decode: Callable[[list[int]], str],
    tokenize: Callable[[str], list[int]],
    limits: TurnLimits,
    *,
    overlap: bool = True,
    num_env_workers: int = 8,
) -> list[Episode]:
    """Run every episode to its end (module docstring); returns them, filled in."""
    ready: list[Episode] = []
    for episode in episodes:
        _observe(episode, tokenize(episode.env.reset(episode.row)), limits)
        if not episode.done:
            ready.append(episode)
    pending: dict[Future, Episode] = {}
    deadlines: dict[Future, float] = {}
    pool = ThreadPoolExecutor(max_workers=num_env_workers, thread_name_prefix="env")
    try:
        while ready or pending:
            if pending and not ready:
                timeout = max(0.0, min(deadlines[f] for f in pending) - time.monotonic())
                timeout = None if math.isinf(timeout) else timeout
                if overlap:
                    wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
                    wait(pending, timeout=GATHER_S)  # steps finishing together share a generate call
                else:
                    wait(pending, timeout=timeout)  # lock-step: the round's every step
            now = time.monotonic()
            for future in [f for f in pending if f.done() or deadlines[f] <= now]:
                episode = pending.pop(future)
                step = _step_result(future) if future.done() else TIMED_OUT
                del deadlines[future]
                if _after_step(episode, step, tokenize, limits):
                    ready.append(episode)
            if ready and (overlap or not pending):
                batch, ready = ready, []
                budgets = [limits.max_response_tokens - len(e.response) for e in batch]
                for episode in batch:
                    episode.seen.append(list(episode.context))
                for episode, (tokens, log_probs, ended) in zip(batch, generate([e.context for e in batch], budgets)):
                    episode.append(tokens, log_probs)
                    episode.turns += 1
                    if not ended:
                        episode.done = episode.truncated = True  # cut mid-turn: no step
                        continue
                    text = decode([t for t in tokens if t != limits.eos_id])
                    future = pool.submit(episode.env.step, text)
                    pending[future], deadlines[future] = episode, time.monotonic() + limits.step_timeout_s
    finally:
        # A step that timed out may still be running: it is not waited for (its result is dropped).
        pool.shutdown(wait=False, cancel_futures=True)
    for episode in episodes:
        episode.env.close()
    return episodes


TIMED_OUT = Step("", 0.0, True, {"tool_errors": 1, "timed_out": True})


def _step_result(future: Future) -> Step:
    """The step's result; an environment that raised ends its episode (reward 0, one error)
    instead of the run."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - any failure of user code ends only its episode
        return Step(f"error: {type(exc).__name__}: {exc}", 0.0, True, {"tool_errors": 1})


def _after_step(episode: Episode, step: Step, tokenize, limits: TurnLimits) -> bool:
    """Record ``step``; True when the episode takes another model turn."""
    last_model = max((i for i, m in enumerate(episode.model_mask) if m), default=0)
    episode.step_rewards.append((last_model, float(step.reward)))
    episode.tool_calls += int(step.info.get("tool_calls", 0))
    episode.tool_errors += int(step.info.get("tool_errors", 0))
    episode.success = episode.success or bool(step.info.get("success", False))
    if step.done:
        episode.done = True
        return False
    if episode.turns >= limits.max_turns:
        episode.done = episode.truncated = True
        return False
    _observe(episode, tokenize(step.observation), limits)
    return not episode.done


def _observe(episode: Episode, tokens: list[int], limits: TurnLimits) -> None:
    """Append observation tokens if a model turn still fits after them, else end truncated."""
    if len(episode.response) + len(tokens) >= limits.max_response_tokens:
        episode.done = episode.truncated = True
        return
    episode.append(tokens)


def episode_fields(
    episodes: list[Episode], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, width: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """The rollout fields of ``hybridflow.data.keys`` for ``episodes`` (B) after their
    left-padded prompts ``prompt_ids``/``prompt_mask`` (B, P); responses right-padded to
    ``width``. Also ``scores`` (B,): each episode's summed rewards, and ``token_rewards``
    (B, width): each step's reward on the last model token of the turn it answered."""
    batch = len(episodes)
    responses = torch.full((batch, width), pad_id, dtype=torch.int64)
    response_mask = torch.zeros(batch, width, dtype=torch.int64)
    real = torch.zeros(batch, width, dtype=torch.int64)
    log_probs = torch.zeros(batch, width)
    token_rewards = torch.zeros(batch, width)
    for i, e in enumerate(episodes):
        n = len(e.response)
        assert n <= width, (n, width)
        responses[i, :n] = torch.tensor(e.response, dtype=torch.int64)
        response_mask[i, :n] = torch.tensor(e.model_mask, dtype=torch.int64)
        real[i, :n] = 1
        log_probs[i, :n] = torch.tensor(e.log_probs, dtype=torch.float32)
        for position, reward in e.step_rewards:
            token_rewards[i, position] += reward
    return {
        K.RESPONSES: responses,
        K.RESPONSE_MASK: response_mask,
        **sequence_fields(prompt_ids, prompt_mask, responses, real),
        K.TRUNCATED: torch.tensor([e.truncated for e in episodes]),
        K.ROLLOUT_LOG_PROBS: log_probs * response_mask,
        K.SCORES: torch.tensor([e.score for e in episodes], dtype=torch.float32),
        K.TOKEN_REWARDS: token_rewards,
    }


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    n = len(episodes)
    return {
        "tool/calls_per_sample": sum(e.tool_calls for e in episodes) / n,
        "rollout/turns_mean": sum(e.turns for e in episodes) / n,
        "env/success": sum(e.success for e in episodes) / n,
        "response/truncated_frac": sum(e.truncated for e in episodes) / n,
    }


def unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Rows of left-padded ``ids`` (B, P) without their padding."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def make_episodes(
    prompts: list[list[int]], rows: list[dict[str, Any]], make_env: Callable[[], Environment], tokenizer=None
) -> list[Episode]:
    """One episode per prompt, each with a fresh environment (given ``tokenizer``)."""
    episodes = []
    for ids, row in zip(prompts, rows):
        env = make_env()
        if tokenizer is not None:
            env.use_tokenizer(tokenizer)
        episodes.append(Episode(list(ids), env, row))
    return episodes


def env_rows(batch) -> list[dict[str, Any]]:
    """What ``Environment.reset`` gets per sample of a prompt batch: ``prompt`` (text),
    ``ground_truth``, ``data_source`` and ``extra_info`` (parsed from its JSON)."""
    import json

    size = batch.batch_size[0]

    def column(key: str, default: str) -> list[str]:
        return batch.get(key).tolist() if key in batch.keys() else [default] * size

    return [
        {"prompt": p, "ground_truth": g, "data_source": d, "extra_info": json.loads(e)}
        for p, g, d, e in zip(
            column(K.PROMPT_TEXT, ""), column(K.GROUND_TRUTH, ""), column(K.DATA_SOURCE, ""),
            column(K.EXTRA_INFO, "null"),
        )
    ]
