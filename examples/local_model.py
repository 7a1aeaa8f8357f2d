"""A run on a local Hugging Face model directory (``source: {path: DIR}``), no download.

The example first writes a tiny Qwen2 and the copy task's character tokenizer into ``DIR`` with
``save_pretrained`` (stand-ins for a model you already have on disk), then runs GRPO with the
actor and the reference loaded from that path::

    python examples/local_model.py                         # 20 iterations, model in runs/tiny-qwen2
    python examples/local_model.py --iterations 2 --model-dir /tmp/tiny

With your own model: ``hybridflow run graphs/grpo.yaml "models.actor.source={path: DIR}"
"models.ref.source={path: DIR}"`` with DIR absolute (the tokenizer is read from DIR too; prompts
must suit it).
"""

from __future__ import annotations

from pathlib import Path

from example_args import parse_args, run_builder


def write_tiny_model(model_dir: Path) -> None:
    """A random-init two-layer Qwen2 and its tokenizer, saved in HF format."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybridflow.data.tasks import get_task

    tokenizer = get_task("copy").tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def main() -> None:
    args = parse_args(__doc__, **{"--model-dir": {"default": "runs/tiny-qwen2"}})

    from hybridflow.graph.library import grpo

    model_dir = Path(args.model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir)
    run_builder(grpo(n=8, source={"path": str(model_dir)}), args, val_interval=args.iterations)


if __name__ == "__main__":
    main()
