"""The client a score node uses for ``hybridflow serve-reward`` servers (``rewards.server``
holds the server and the wire format), and ``RewardSources``: every scorer of a reward model.

The client keeps one pooled ``httpx`` connection per server open between batches. It splits a
batch whose JSON body would exceed its ``max_request_bytes`` and rejects a response over
``max_response_bytes`` (read as it streams in) or holding a score that is not finite in float32.
It retries a failed request (connection error, timeout,
5xx, malformed answer) ``retries`` times, waiting ``backoff_s * 2**k`` before retry ``k``; a 4xx
is not retried. ``RewardSources`` scores a batch with every component (servers and local rules)
and aggregates them (weighted sum, mean, min or max), keeping each component's scores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import torch

from hybridflow.rewards.pool import ScorePool
from hybridflow.rewards.rule import RewardError, is_finite_score, load_rule, score_items
from hybridflow.spec.graph import ModelSource, RemoteRewardSpec

# A component's (B,) scores ride in the batch as "<score key>/<name>", e.g. "scores/copy".


# -- client ---------------------------------------------------------------------------------------


class RemoteRewardError(RuntimeError):
    """A reward server could not give valid scores within the retries."""


@dataclass
class RemoteScorer:
    """Scores batches on one ``serve-reward`` server (module docstring)."""

    url: str
    timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.2
    max_request_bytes: int = 1 << 20
    max_response_bytes: int = 1 << 20
    num_retries: int = field(default=0, init=False)  # retries done so far (a metric)
    _client: httpx.Client | None = field(default=None, init=False, repr=False)  # pooled connections

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str]
    ) -> list[float]:
        body = json.dumps(
            {"prompts": list(prompts), "responses": list(responses), "ground_truths": list(ground_truths)}
        ).encode()
        if len(body) > self.max_request_bytes:
            if len(prompts) == 1:
                raise RemoteRewardError(
                    f"{self.url}: one sample is {len(body)} bytes of JSON > max_request_bytes="
                    f"{self.max_request_bytes}"
                )
            half = len(prompts) // 2
            return self.score(prompts[:half], responses[:half], ground_truths[:half]) + self.score(
                prompts[half:], responses[half:], ground_truths[half:]
            )
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.num_retries += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._post(body, len(prompts))
            except _Permanent as exc:
                raise RemoteRewardError(f"{self.url}: {exc}") from None
            except (OSError, ValueError) as exc:  # URLError, timeouts, resets, bad answers
                last = f"{type(exc).__name__}: {exc}"
        raise RemoteRewardError(f"{self.url}: failed after {self.retries + 1} attempts ({last})")

    def _post(self, body: bytes, num_samples: int) -> list[float]:
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s, headers={"Content-Type": "application/json"})
        try:
            with self._client.stream("POST", self.url.rstrip("/") + "/score", content=body) as response:
                raw = b""
                for chunk in response.iter_bytes():
                    raw += chunk
                    if len(raw) > self.max_response_bytes:
                        raise ValueError(f"response over max_response_bytes={self.max_response_bytes}")
        except httpx.HTTPError as exc:  # connection refused or reset, timeouts, protocol errors
            raise OSError(f"{type(exc).__name__}: {exc}") from None
        if 400 <= response.status_code < 500:
            raise _Permanent(f"HTTP {response.status_code} {response.reason_phrase}: {_error_of(raw)}")
        if response.status_code >= 300:
            raise OSError(f"HTTP {response.status_code} {response.reason_phrase}: {_error_of(raw)}")
        try:
            scores = json.loads(raw)["scores"]
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            raise ValueError(f"response is not {{'scores': [...]}} JSON: {raw[:80]!r}") from None
        if not isinstance(scores, list) or len(scores) != num_samples:
            raise ValueError(f"expected {num_samples} scores, got {str(scores)[:80]}")
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and is_finite_score(s) for s in scores):
            raise ValueError(f"scores must be numbers finite in float32, got {str(scores)[:80]}")
        return [float(s) for s in scores]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _error_of(raw: bytes) -> str:
    """A server's ``{"error": ...}`` reason, or the start of whatever it sent."""
    try:
        return str(json.loads(raw)["error"])[:200]
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return repr(raw[:80])


class _Permanent(Exception):
    """A failure a retry cannot fix (a 4xx answer)."""


# -- several sources, aggregated ------------------------------------------------------------------


def aggregate(components: dict[str, torch.Tensor], weights: dict[str, float], mode: str) -> torch.Tensor:
    """(B,) aggregate of the components' (B,) scores: weighted_sum, mean, min or max."""
    stacked = torch.stack(list(components.values()))  # (C, B)
    if mode == "weighted_sum":
        w = torch.tensor([weights[name] for name in components], dtype=stacked.dtype)
        return (w[:, None] * stacked).sum(0)
    if mode == "mean":
        return stacked.mean(0)
    if mode == "min":
        return stacked.min(0).values
    if mode == "max":
        return stacked.max(0).values
    raise AssertionError(f"unknown aggregate {mode!r}")


@dataclass
class ScoreResult:
    scores: torch.Tensor  # (B,) float32
    components: dict[str, torch.Tensor]  # name -> (B,) float32; empty for a single source
    num_errors: int  # samples (per component) that got the default reward
    num_retries: int = 0
    # Other numeric keys of compute_score dicts: "<component>/<key>" (or "<key>") -> (B,)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


DEFAULT_COMPUTE_SCORE = "hybridflow.rewards.default:compute_score"
# Scorers cheap and plain enough to run in the worker's process by default: pure Python on
# short strings, microseconds a call, no signals. A scoring process costs more than their calls.
IN_PROCESS_RULES = ("hybridflow.data.tasks:",)


def row_fields(batch) -> dict[str, list]:
    """``data_sources`` and ``extra_infos`` (decoded) of a batch, for ``RewardSources.score``."""
    from hybridflow.data import keys as K

    present = batch.keys()
    fields = {}
    if K.DATA_SOURCE in present:
        fields["data_sources"] = batch.get(K.DATA_SOURCE).tolist()
    if K.EXTRA_INFO in present:
        fields["extra_infos"] = [json.loads(text) for text in batch.get(K.EXTRA_INFO).tolist()]
    return fields


def _function_path(name: str) -> str:
    return DEFAULT_COMPUTE_SCORE if name == "default" else name


def score_function_paths(source: ModelSource) -> list[tuple[str, str, float]]:
    """``(metric name, 'module:function', weight)`` of each compute_score function of a source."""
    spec = source.compute_score
    if spec is None:
        return []
    if isinstance(spec, str):
        return [("score", _function_path(spec), 1.0)]
    return [
        (f.name or _function_path(f.function).rpartition(":")[2], _function_path(f.function), f.weight)
        for f in spec
    ]


class RewardSources:
    """A reward/cost model's scorer: one rule (``source.rule``), verl-style ``compute_score``
    function(s), or several aggregated remote/rule sources.

    Local calls (rules and compute_score) run in a ``ScorePool`` of ``num_workers`` processes
    (``rewards.pool``; the score node's ``options.num_workers``), or in this process when it
    is 0 (``rewards.in_process``); None picks 0 when every local scorer is a built-in task rule
    (``IN_PROCESS_RULES``), else 1. Several compute_score functions give the weighted sum of their scores, each kept as a
    component.
    """

    def __init__(self, source: ModelSource) -> None:
        self.spec: RemoteRewardSpec | None = source.remote
        self.weights: dict[str, float] = {}
        # name -> (where, kind, scorer): kind "rule" | "compute_score" | "remote"
        self.sources: dict[str, tuple[str, str, object]] = {}
        if source.rule is not None:
            self.sources["rule"] = (source.rule, "rule", load_rule(source.rule))
        for name, path, weight in score_function_paths(source):
            self.sources[name] = (path, "compute_score", load_rule(path))
            self.weights[name] = weight
        for c in self.spec.components if self.spec is not None else ():
            if c.rule is not None:
                self.sources[c.name] = (c.rule, "rule", load_rule(c.rule))
            else:
                self.sources[c.name] = (c.url, "remote", RemoteScorer(
                    c.url, self.spec.timeout_s, self.spec.retries, self.spec.backoff_s,
                    self.spec.max_request_bytes, self.spec.max_response_bytes,
                ))
            self.weights[c.name] = c.weight
        self.single = len(self.sources) == 1 and self.spec is None
        self._pool: ScorePool | None = None

    def _pool_of(self, num_workers: int | None) -> ScorePool | None:
        local = [where for where, kind, _ in self.sources.values() if kind != "remote"]
        if num_workers is None:
            num_workers = 0 if all(where.startswith(IN_PROCESS_RULES) for where in local) else 1
        if num_workers == 0 or not local:
            return None
        if self._pool is None or self._pool.num_workers != num_workers:
            self.close()
            self._pool = ScorePool(num_workers, preload=local)
            self._pool.start()
        return self._pool

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        *,
        on_error: str,
        default_reward: float,
        timeout_s: float | None,
        num_workers: int | None = 0,
        batch_timeout_s: float | None = None,
        max_timeout_frac: float | None = None,
        data_sources: Sequence[str] | None = None,
        extra_infos: Sequence[dict | None] | None = None,
    ) -> ScoreResult:
        num = len(prompts)
        data_sources = list(data_sources) if data_sources is not None else [""] * num
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * num
        pool = self._pool_of(num_workers)
        components, extras, num_errors, num_retries = {}, {}, 0, 0
        for name, (where, kind, scorer) in self.sources.items():
            if kind == "remote":
                before = scorer.num_retries
                try:
                    values = torch.tensor(scorer.score(prompts, responses, ground_truths), dtype=torch.float32)
                except RemoteRewardError as exc:
                    if on_error == "fail":
                        raise RewardError(f"reward {name}: {exc}") from None
                    values = torch.full((num,), default_reward, dtype=torch.float32)
                    num_errors += num
                num_retries += scorer.num_retries - before
            else:
                if kind == "rule":
                    items = list(zip(prompts, responses, ground_truths))
                else:
                    items = list(zip(data_sources, responses, ground_truths, extra_infos))
                values, errors, more = score_items(
                    scorer if pool is None else where, items, pool, on_error=on_error,
                    default_reward=default_reward, timeout_s=timeout_s, name=where,
                    batch_timeout_s=batch_timeout_s, max_timeout_frac=max_timeout_frac,
                )
                num_errors += errors
                extras.update({(key if self.single else f"{name}/{key}"): v for key, v in more.items()})
            components[name] = values
        if self.single:
            return ScoreResult(next(iter(components.values())), {}, num_errors, num_retries, extras)
        mode = self.spec.aggregate if self.spec is not None else "weighted_sum"
        scores = aggregate(components, self.weights, mode)
        return ScoreResult(scores, components, num_errors, num_retries, extras)

    def close(self) -> None:
        for _, kind, scorer in self.sources.values():
            if kind == "remote":
                scorer.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
