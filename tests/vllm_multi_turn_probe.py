"""Run by tests/test_envs.py in its own interpreter (vLLM in-process wants a fresh one): product
episodes with vLLM's generate_turns; prints JSON: for each episode its model mask, whether each
turn ended by itself, and the largest |vLLM log-prob - training forward log-prob| on model
tokens."""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from hybridflow.data.tasks import TASKS  # noqa: E402
from hybridflow.engines.base import SamplingParams  # noqa: E402
from hybridflow.engines.models import build_causal_lm  # noqa: E402
from hybridflow.engines.vllm import VLLMRolloutEngine, save_for_vllm  # noqa: E402
from hybridflow.envs.base import env_factory  # noqa: E402
from hybridflow.envs.rollout import TurnLimits, episode_fields, make_episodes, run_episodes, unpadded  # noqa: E402
from hybridflow.spec.graph import ModelSource  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    tok = TASKS["product"].tokenizer()
    module = build_causal_lm(ModelSource(config={"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                                 "num_key_value_heads": 1}),
                             len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    model_dir = save_for_vllm(module, tok, tempfile.mkdtemp(prefix="vllm-mt-"))
    engine = VLLMRolloutEngine(model_dir, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, max_model_len=48,
                               seed=0, tokenizer=tok)
    rows = TASKS["product"].make_prompts(32, 0)
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    make_env = env_factory("product")
    params = SamplingParams(temperature=1.0)
    width = 32
    episodes = make_episodes(prompts, rows, make_env)
    run_episodes(episodes, lambda c, b: engine.generate_turns(c, b, params, make_env().stop_strings()),
                 lambda ids: tok.decode(ids, skip_special_tokens=True),
                 lambda text: tok.encode(text, add_special_tokens=False), TurnLimits(3, width, tok.eos_token_id))
    prompt_ids = torch.tensor(prompts)
    fields = episode_fields(episodes, prompt_ids, torch.ones_like(prompt_ids), width, tok.pad_token_id)
    with torch.no_grad():
        logits = module(input_ids=fields["input_ids"], attention_mask=fields["attention_mask"],
                        position_ids=fields["position_ids"]).logits[:, -width - 1:-1]
    train = torch.log_softmax(logits.float(), -1).gather(-1, fields["responses"][..., None])[..., 0]
    mask = fields["response_mask"].bool()
    print(json.dumps({
        "diff_max": float((train - fields["rollout_log_probs"]).abs()[mask].max()),
        "model_masks": [e.model_mask for e in episodes],
        "responses": [tok.decode(e.response) for e in episodes],
        "turns": [e.turns for e in episodes],
        "tool_calls": sum(e.tool_calls for e in episodes),
    }))
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine core can hang at interpreter exit


if __name__ == "__main__":
    main()
