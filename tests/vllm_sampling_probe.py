"""vLLM's side of tests/test_trl_sampling.py, run in a fresh interpreter: ``python PROBE OUT``.

vLLM patches torch settings of the process that imports or builds it, so the test runs this
script as a subprocess and compares what it writes (a torch file) with the transformers
reference in the test process. Two parts:

- vLLM 0.32's ``Sampler`` (the CPU path hybridflow's engine runs) on fixed logits, for each
  (temperature, top-k, top-p) of ``SETTINGS``, in the ``logprobs_mode`` the engine picks for
  that temperature: the sampled tokens, the log-probs it records, and the tokens its top-k/top-p
  mask keeps;
- a real ``VLLMRolloutEngine`` on the tiny model (seed 0) at temperature 1 with top-k and top-p
  on: its responses and recorded log-probs.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# vLLM compiles a rank-counting helper of its sampler on first use (tens of seconds on CPU);
# eager runs the same math.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

# (temperature, top_k, top_p); top_k 0 and top_p 1 are off.
SETTINGS = [(1.0, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (1.0, 5, 0.8), (0.7, 0, 1.0), (1.4, 0, 1.0),
            (0.7, 5, 0.8)]
NUM_BASE_ROWS, REPEATS, VOCAB = 6, 4000, 24
ENGINE_SAMPLING = {"temperature": 1.0, "top_k": 4, "top_p": 0.9}
ENGINE_PROMPTS = ["abc=", "hhgfe=", "d=", "fedcba="]
ENGINE_N, ENGINE_MAX_NEW = 16, 8
TINY = {"hidden_size": 64, "num_hidden_layers": 2}  # 2 heads of 32: vLLM's CPU kernel takes it


def base_logits() -> torch.Tensor:
    """(NUM_BASE_ROWS, VOCAB): rows from flat to peaked, one with tied logits."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(NUM_BASE_ROWS, VOCAB, generator=gen) * torch.tensor([0.3, 1.0, 2.0, 3.0, 5.0, 1.5])[:, None]
    rows[5, :6] = rows[5, :6].max()  # a tie at the top
    return rows


def _metadata(num_rows: int, temperature: float, top_k: int, top_p: float):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((num_rows,), temperature), all_greedy=False, all_random=True,
        top_p=torch.full((num_rows,), top_p) if top_p < 1.0 else None,
        top_k=torch.full((num_rows,), top_k, dtype=torch.int32) if top_k else None,
        generators={}, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_rows), presence_penalties=torch.zeros(num_rows),
        repetition_penalties=torch.ones(num_rows), output_token_ids=[[] for _ in range(num_rows)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def sampler_part() -> dict:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    from hybridflow.engines.vllm import vllm_logprobs_mode

    torch.manual_seed(0)
    base = base_logits()
    logits = base.repeat_interleave(REPEATS, dim=0)
    out = {}
    for temperature, top_k, top_p in SETTINGS:
        num = logits.shape[0]
        md = _metadata(num, temperature, top_k, top_p)
        mode = vllm_logprobs_mode(temperature)
        result = Sampler(logprobs_mode=mode)(logits.clone(), md)
        kept = apply_top_k_top_p(
            base / temperature, md.top_k[:NUM_BASE_ROWS] if top_k else None,
            md.top_p[:NUM_BASE_ROWS] if top_p < 1.0 else None,
        )
        out[(temperature, top_k, top_p)] = {
            "mode": mode,
            "sampled": result.sampled_token_ids[:, 0].long(),
            "recorded": result.logprobs_tensors.logprobs[:, 0].clone(),
            "recorded_ids": result.logprobs_tensors.logprob_token_ids[:, 0].long(),
            "kept": torch.isfinite(kept),
        }
    return {"base": base, "settings": out}


def engine_part() -> dict:
    import tempfile

    from tensordict import TensorDict

    from hybridflow.data import keys as K
    from hybridflow.data.tasks import get_task
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.engines.vllm import VLLMRolloutEngine, save_for_vllm
    from hybridflow.spec.graph import ModelSource

    tokenizer = get_task("copy").tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    module = build_causal_lm(ModelSource(config=TINY), len(tokenizer), pad, eos, seed=0)
    model_dir = save_for_vllm(module, tokenizer, tempfile.mkdtemp(prefix="vllm-sampling-"))
    engine = VLLMRolloutEngine(model_dir, eos_id=eos, pad_id=pad, max_model_len=32, seed=0,
                               temperature=ENGINE_SAMPLING["temperature"])
    enc = tokenizer(ENGINE_PROMPTS, padding=True, return_tensors="pt")
    prompts = TensorDict({K.PROMPT_IDS: enc["input_ids"], K.PROMPT_MASK: enc["attention_mask"],
                          K.UID: torch.arange(len(ENGINE_PROMPTS))}, batch_size=[len(ENGINE_PROMPTS)])
    out = engine.generate(prompts, SamplingParams(n=ENGINE_N, max_new_tokens=ENGINE_MAX_NEW, **ENGINE_SAMPLING))
    try:
        engine.generate(prompts, SamplingParams(n=1, max_new_tokens=2, temperature=0.5))
        wrong_temperature = None
    except ValueError as exc:
        wrong_temperature = str(exc)
    keys = (K.RESPONSES, K.RESPONSE_MASK, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.ROLLOUT_LOG_PROBS)
    return {"engine": {k: out[k].clone() for k in keys}, "wrong_temperature": wrong_temperature}


def main(path: str) -> None:
    torch.save(sampler_part() | engine_part(), path)


if __name__ == "__main__":
    main(sys.argv[1])
