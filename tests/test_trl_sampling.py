"""Sampling equivalence with TRL 1.16: for the same logits, temperature, top-k and top-p, the
tokens that may be sampled and the recorded log-probs equal what TRL's generation uses.

TRL (transformers path) samples through transformers' warpers temperature -> top-k -> top-p
(``trl_reference.generation_config`` / ``allowed_tokens``), records nothing at generation and
reads each sampled token's log-prob from its training forward, ``log_softmax(logits / T)``
over the whole vocabulary. Both rollout engines are held to that:

- transformers engine: the same seed gives TRL's tokens exactly, the reference warpers keep
  exactly the tokens ``generate`` kept, and the recorded log-probs are TRL's forward's;
- vLLM engine: its sampler keeps the same tokens and samples only from them; what it records is
  the full-vocabulary log-prob wherever vLLM 0.32 offers a mode for it (temperature 1, or no
  filter), and otherwise exactly that plus ``-log(kept mass)`` (the documented difference).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import trl_reference as trl
from hybridflow.data import keys as K
from hybridflow.data.tasks import get_task
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.hf_rollout import HFRolloutEngine
from hybridflow.engines.models import build_causal_lm
from hybridflow.spec.graph import ModelSource

TOKENIZER = get_task("copy").tokenizer()
EOS, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
PROMPTS = ["abc=", "hhgfe=", "d=", "fedcba="]
N, MAX_NEW = 16, 6
TINY = {"hidden_size": 64, "num_hidden_layers": 2}
# (temperature, top_k, top_p); top_k 0 and top_p 1 are off.
HF_SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (0.7, 0, 0.8), (0.7, 3, 0.8), (1.3, 5, 0.95)]
PROBE = Path(__file__).with_name("vllm_sampling_probe.py")


def _model():
    return build_causal_lm(ModelSource(config=TINY), len(TOKENIZER), PAD, EOS, seed=0).eval()


def _prompts(texts: list[str]) -> TensorDict:
    enc = TOKENIZER(texts, padding=True, return_tensors="pt")
    return TensorDict({K.PROMPT_IDS: enc["input_ids"], K.PROMPT_MASK: enc["attention_mask"],
                       K.UID: torch.arange(len(texts))}, batch_size=[len(texts)])


def _trl_logps(model, batch: TensorDict, temperature: float) -> torch.Tensor:
    """TRL's training-side log-probs of the sampled tokens (its forward: no position ids)."""
    with torch.no_grad():
        return trl.per_token_logps(model, batch[K.INPUT_IDS], batch[K.ATTENTION_MASK],
                                   batch[K.RESPONSES].shape[1], temperature)


@pytest.mark.parametrize("temperature, top_k, top_p", HF_SETTINGS)
def test_hf_engine_samples_as_trl(temperature, top_k, top_p):
    model = _model()
    prompts = _prompts(PROMPTS)
    config = trl.generation_config(temperature, top_k, top_p, MAX_NEW, PAD, EOS)
    config.update(output_logits=True, output_scores=True, return_dict_in_generate=True)
    torch.manual_seed(1)
    with torch.no_grad():
        theirs = model.generate(input_ids=prompts[K.PROMPT_IDS].repeat_interleave(N, 0),
                                attention_mask=prompts[K.PROMPT_MASK].repeat_interleave(N, 0),
                                generation_config=config)
    torch.manual_seed(1)
    ours = HFRolloutEngine(model, eos_id=EOS, pad_id=PAD).generate(
        prompts, SamplingParams(n=N, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=MAX_NEW)
    )
    mask = ours[K.RESPONSE_MASK].bool()
    generated = theirs.sequences[:, prompts[K.PROMPT_IDS].shape[1]:]
    num_steps = generated.shape[1]
    # Same seed, same tokens: the engine samples from TRL's distribution.
    assert torch.equal(ours[K.RESPONSES][:, :num_steps][mask[:, :num_steps]], generated[mask[:, :num_steps]])
    # The reference warpers keep exactly what generate kept, and every sampled token is kept.
    raw = torch.stack(theirs.logits, dim=1)  # (B, L, V) before any warper
    processed = torch.stack(theirs.scores, dim=1)
    allowed = trl.allowed_tokens(raw.flatten(0, 1), temperature, top_k, top_p).view(raw.shape)
    assert torch.equal(allowed, torch.isfinite(processed))
    picked = allowed.gather(-1, generated[..., None])[..., 0]
    assert bool(picked[mask[:, :num_steps]].all())
    if top_k or top_p < 1.0:
        assert int(allowed.sum(-1).min()) < allowed.shape[-1], "the filters must remove some tokens"
    # Recorded log-probs: TRL's training forward's, over the whole vocabulary.
    reference = _trl_logps(model, ours, temperature)
    assert (ours[K.ROLLOUT_LOG_PROBS] - reference).abs()[mask].max() < 1e-5
    assert bool((ours[K.ROLLOUT_LOG_PROBS][~mask] == 0).all())


def test_the_hf_checks_fail_for_a_setting_trl_does_not_use():
    """Broken on purpose: an engine that samples at temperature 0.7 with top-k 3 against TRL at
    temperature 1 with top-k 2 fails both checks above (log-probs, and sampled tokens TRL keeps)."""
    model = _model()
    prompts = _prompts(PROMPTS)
    torch.manual_seed(1)
    ours = HFRolloutEngine(model, eos_id=EOS, pad_id=PAD).generate(
        prompts, SamplingParams(n=N, temperature=0.7, top_k=3, top_p=1.0, max_new_tokens=MAX_NEW)
    )
    mask = ours[K.RESPONSE_MASK].bool()
    assert (ours[K.ROLLOUT_LOG_PROBS] - _trl_logps(model, ours, 1.0)).abs()[mask].max() > 1e-3
    with torch.no_grad():
        hidden = model.model(input_ids=ours[K.INPUT_IDS], attention_mask=ours[K.ATTENTION_MASK],
                             position_ids=ours[K.POSITION_IDS]).last_hidden_state
        num = ours[K.RESPONSES].shape[1]
        logits = model.lm_head(hidden[:, -num - 1 : -1])
    allowed = trl.allowed_tokens(logits.flatten(0, 1), 1.0, 2, 1.0).view(logits.shape)
    picked = allowed.gather(-1, ours[K.RESPONSES][..., None])[..., 0]
    assert not bool(picked[mask].all()), "top-k 3 sampled only tokens TRL's top-k 2 keeps"


@pytest.fixture(scope="module")
def vllm_probe(tmp_path_factory) -> dict:
    pytest.importorskip("vllm", reason="vllm (the .[vllm] extra) is not installed")
    out = tmp_path_factory.mktemp("vllm_probe") / "probe.pt"
    subprocess.run([sys.executable, str(PROBE), str(out)], check=True, timeout=600,
                   cwd=Path(__file__).resolve().parent)
    return torch.load(out)


@pytest.mark.slow
def test_vllm_sampler_keeps_trl_tokens_and_records_full_vocabulary_log_probs(vllm_probe):
    import vllm_sampling_probe as probe

    base = vllm_probe["base"]
    for (temperature, top_k, top_p), got in vllm_probe["settings"].items():
        setting = (temperature, top_k, top_p)
        allowed = trl.allowed_tokens(base, temperature, top_k, top_p)
        assert torch.equal(got["kept"], allowed), setting
        rows = torch.arange(base.shape[0]).repeat_interleave(probe.REPEATS)
        sampled = got["sampled"]
        assert torch.equal(got["recorded_ids"], sampled)
        assert bool(allowed[rows, sampled].all()), setting
        # The draws follow the kept tokens' renormalised probabilities (total variation).
        kept_probs = torch.softmax(base / temperature, dim=-1) * allowed
        kept_probs = kept_probs / kept_probs.sum(-1, keepdim=True)
        for row in range(base.shape[0]):
            freq = torch.bincount(sampled[rows == row], minlength=base.shape[1]) / probe.REPEATS
            assert 0.5 * (freq - kept_probs[row]).abs().sum() < 0.05, (setting, row)
        full = torch.log_softmax(base / temperature, dim=-1)[rows, sampled]
        filtered = bool(top_k) or top_p < 1.0
        if temperature == 1.0 or not filtered:
            assert (got["recorded"] - full).abs().max() < 1e-5, setting
        else:  # vLLM has no mode for it: renormalised over the kept tokens
            kept_mass = (torch.softmax(base / temperature, dim=-1) * allowed).sum(-1)[rows]
            assert (got["recorded"] - (full - kept_mass.log())).abs().max() < 1e-5, setting
            assert (got["recorded"] - full).min() > 1e-3, setting


@pytest.mark.slow
def test_vllm_engine_samples_as_trl(vllm_probe):
    import vllm_sampling_probe as probe

    out = TensorDict(vllm_probe["engine"], batch_size=[len(probe.ENGINE_PROMPTS) * probe.ENGINE_N])
    sampling = probe.ENGINE_SAMPLING
    model = _model()
    mask = out[K.RESPONSE_MASK].bool()
    with torch.no_grad():
        hidden = model.model(input_ids=out[K.INPUT_IDS], attention_mask=out[K.ATTENTION_MASK],
                             position_ids=out[K.POSITION_IDS]).last_hidden_state
        num = out[K.RESPONSES].shape[1]
        logits = model.lm_head(hidden[:, -num - 1 : -1])  # the logits each response token was drawn from
    allowed = trl.allowed_tokens(logits.flatten(0, 1), sampling["temperature"], sampling["top_k"],
                                 sampling["top_p"]).view(logits.shape)
    picked = allowed.gather(-1, out[K.RESPONSES][..., None])[..., 0]
    assert bool(picked[mask].all()), "vLLM sampled a token TRL's warpers remove"
    assert int(allowed.sum(-1).min()) < allowed.shape[-1]
    reference = _trl_logps(model, out, sampling["temperature"])
    assert (out[K.ROLLOUT_LOG_PROBS] - reference).abs()[mask].max() < 1e-4
    assert "temperature 1" in vllm_probe["wrong_temperature"]
