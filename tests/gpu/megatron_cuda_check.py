"""One-shot check of the megatron-core train engine on a single CUDA GPU (TP=1), no network.

    python tests/gpu/megatron_cuda_check.py [--wheels DIR] [--hidden 1024 --layers 8 ...]

Runs, in one process on one GPU (nccl, world size 1):

1. HF equivalence: an HF Qwen2 (every tensor random) converted to megatron ``GPTModel``; raw logits
   and the engine's log-probs/entropy (left-padded batch, temperature 0.7) against the HF model
   (same GPU, TF32 off), and the gathered weights back to HF bit-exact.
2. Two training steps against HF + torch AdamW on the same GPU (loss, grad norm, weights).
3. Throughput: a larger model (``--hidden/--layers``), timed ``train_step`` calls; prints
   tokens/s (all tokens of the batch, prompt + response) and response tokens/s.

Missing packages. The target machine has CUDA torch and transformers but no megatron-core (and
possibly no tensordict/pydantic). Missing ones are installed without network from wheels in
``--wheels`` (default ``tests/gpu/wheels``) into ``tests/gpu/.vendor`` and put on ``sys.path``.
Fetch the wheels on a machine with PyPI access (Python 3.12, x86-64 Linux) with::

    make gpu-wheels        # = the pip download line printed below when a package is missing

Exit status: 0 all checks passed, 1 a check failed, 2 the machine cannot run it (no CUDA, or a
package missing with no wheel for it).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# module -> requirement; pinned as in setup.cfg. --no-deps installs: the list is the closure that
# torch + transformers do not already bring.
NEEDED = {
    "megatron.core": "megatron-core==0.16.1",
    "tensordict": "tensordict==0.15.3",
    "pyvers": "pyvers==0.2.3",
    "cloudpickle": "cloudpickle==3.1.3",
    "pydantic": "pydantic==2.14.3",
    "pydantic_core": "pydantic-core==2.50.4",
    "annotated_types": "annotated-types==0.8.0",
    "typing_inspection": "typing-inspection==0.4.5",
    "networkx": "networkx",
}
DOWNLOAD = (
    "pip download --no-deps --only-binary=:all: --python-version 3.12 "
    "--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d tests/gpu/wheels " + " ".join(f"'{r}'" for r in NEEDED.values())
)


def ensure_packages(wheels: Path) -> None:
    vendor = HERE / ".vendor"
    sys.path.insert(0, str(vendor))
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    missing = []
    for module, requirement in NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(requirement)
    if not missing:
        return
    if not wheels.is_dir():
        print(f"missing {missing} and no wheel directory {wheels}; on a machine with PyPI run:\n  {DOWNLOAD}")
        sys.exit(2)
    print(f"installing {missing} from {wheels} into {vendor}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(wheels),
           "--target", str(vendor), *missing]
    if subprocess.run(cmd).returncode != 0:
        print(f"could not install {missing} from {wheels}; fetch them with:\n  {DOWNLOAD}")
        sys.exit(2)
    importlib.invalidate_caches()
    for module in NEEDED:
        importlib.import_module(module)


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=HERE / "wheels")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument(
        "--cpu", action="store_true", help="smoke-run the script itself on CPU/gloo (tests use it)"
    )
    args = parser.parse_args()

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: this check needs one GPU")
        return 2
    ensure_packages(args.wheels)
    torch.backends.cuda.matmul.allow_tf32 = False  # equivalence at float32 precision
    torch.backends.cudnn.allow_tf32 = False
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.cpu:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)

    from megatron_harness import pg_loss, random_batch, tiny_hf

    from hybridflow.data import keys as K
    from hybridflow.engines.megatron import MegatronTrainEngine, cpu_compat
    from hybridflow.engines.torch_engine import TorchTrainEngine
    from hybridflow.spec.engines import TorchTrainSpec
    from hybridflow.spec.graph import OptimSpec, TrainEngineSpec
    from hybridflow.spec.layout import ParallelLayout

    dev = torch.device("cpu" if args.cpu else "cuda")
    name = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    print(f"torch {torch.__version__}, {name}, cpu_compat active: {cpu_compat.needed()}")
    ok = True
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize

    # 1. HF equivalence at TP=1 on CUDA.
    hf = tiny_hf(tied=True).to(dev)
    spec = TrainEngineSpec(engine="megatron", layout=ParallelLayout(tp=1), micro_batch_size=3)
    engine = MegatronTrainEngine(copy.deepcopy(hf), spec)
    ids = torch.randint(0, hf.config.vocab_size, (2, 9), device=dev)
    with torch.no_grad():
        out = engine.gpt_model(ids, torch.arange(9, device=dev)[None].expand(2, -1), cpu_compat.causal_mask(9, dev))
        err = float((out[..., : hf.config.vocab_size] - hf(input_ids=ids).logits).abs().max())
    ok &= check("logits vs HF", err < 1e-5, f"max abs diff {err:.2e} (tol 1e-5)")
    batch = random_batch(7)
    got = engine.forward(batch, temperature=0.7)
    want = TorchTrainEngine(copy.deepcopy(hf), TorchTrainSpec(micro_batch_size=4)).forward(batch.to(dev), 0.7)
    for key in ("log_probs", "entropy"):
        err = float((got[key] - want[key].cpu()).abs().max())
        ok &= check(f"{key} vs HF", err < 1e-5, f"max abs diff {err:.2e} (tol 1e-5)")
    full = engine.full_hf_state()
    exact = all(torch.equal(full[n], t) for n, t in hf.state_dict().items())
    ok &= check("megatron -> HF round trip", exact, "bit-exact" if exact else "differs")
    del engine

    # 2. Two training steps vs HF + torch AdamW (the reference step written out: the torch
    #    engine's bookkeeping is CPU-only).
    lr, clip = 1e-3, 0.05
    optim = OptimSpec(lr=lr, betas=(0.9, 0.99), grad_clip=clip)
    ref_model = copy.deepcopy(hf)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    ref_engine = TorchTrainEngine(ref_model, TorchTrainSpec(micro_batch_size=8))
    engine = MegatronTrainEngine(
        copy.deepcopy(hf), TrainEngineSpec(engine="megatron", micro_batch_size=2, optim=optim), total_steps=3
    )
    for step in range(2):
        b = random_batch(8, seed=10 + step)
        out = ref_engine._outputs(ref_model, b.to(dev), 1.0)
        out["num_global_tokens"] = b[K.RESPONSE_MASK].sum().float().to(dev)
        ref_loss = pg_loss(b.to(dev), out)[0]
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip))
        ref_opt.step()
        g = engine.train_step(b, pg_loss)
        for key, want in (("loss", float(ref_loss)), ("grad_norm", ref_norm)):
            err = abs(g[key] - want)
            ok &= check(f"step {step} {key}", err < 1e-5 * max(1, abs(want)), f"{g[key]:.6f} vs {want:.6f}")
    full = engine.full_hf_state()
    err = max(float((full[n] - p.detach()).abs().max()) for n, p in ref_model.named_parameters())
    ok &= check("weights after 2 AdamW steps", err < 2e-2 * lr, f"max abs diff {err:.2e} (tol 2% of lr)")
    del engine, ref_model, ref_opt

    # 3. Throughput at TP=1.
    dtype = getattr(torch, args.dtype)
    big = tiny_hf(
        tied=False,
        vocab_size=args.vocab,
        std=0.02,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.prompt_len + args.response_len,
    ).to(dev, dtype)
    num_params = sum(p.numel() for p in big.parameters())
    spec = TrainEngineSpec(
        engine="megatron", micro_batch_size=args.micro_batch, dtype=args.dtype, optim=OptimSpec(lr=1e-5)
    )
    engine = MegatronTrainEngine(big, spec, total_steps=args.steps + 1)
    b = random_batch(args.batch, prompt_len=args.prompt_len, response_len=args.response_len, seed=5)
    engine.train_step(b, pg_loss)  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        metrics = engine.train_step(b, pg_loss)
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    tokens = int(b[K.ATTENTION_MASK].sum())
    peak = 0.0 if args.cpu else torch.cuda.max_memory_allocated() / 2**30
    print(
        f"throughput: {num_params / 1e6:.0f}M params, {args.dtype}, batch {args.batch} x "
        f"{args.prompt_len + args.response_len} tokens: {seconds * 1e3:.1f} ms/step, "
        f"{tokens / seconds:,.0f} tokens/s ({int(b[K.RESPONSE_MASK].sum()) / seconds:,.0f} response "
        f"tokens/s), peak memory {peak:.1f} GiB, loss {metrics['loss']:.4f}"
    )
    ok &= check("throughput step finite", metrics["skipped_step"] == 0.0, f"grad_norm {metrics['grad_norm']:.3f}")
    dist.destroy_process_group()
    print("ALL PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
