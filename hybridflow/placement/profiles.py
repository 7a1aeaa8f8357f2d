"""Hardware profiles and model architectures for the cost simulator, as plain data.

A ``HardwareProfile`` is what one device of a pool can do: peak dense bf16 FLOP/s, memory and
its bandwidth, and the links between devices. Numbers are vendor datasheet values (cited per
field below). What a real program reaches is a fraction of peak; that fraction is one
documented efficiency factor per kind of work (training, forward/prefill, decode, collective
communication), the same for every GPU profile. They are round assumptions, not fitted to any
paper's results; ``calibrate`` replaces them with rates fitted from measured single-node runs.

CPU profiles differ in one way: their "devices" are worker processes, and processes that share
physical cores share them. ``physical_cores`` caps how many devices compute at full rate at the
same time; the simulator slows every busy device by ``busy_devices / physical_cores`` beyond it.
CPU work also carries a fixed per-call overhead (Ray dispatch, batch split and collect), which
dominates tiny models.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

GB = 1e9
TB = 1e12

# Fractions of peak reached in practice, one per kind of work. Assumptions, documented here
# once: dense transformer training in Megatron-style frameworks is commonly reported at
# 35-55 % MFU on A100/H100, so 0.4; a forward pass (prefill, log-prob, values) has no backward
# recompute and fewer optimizer stalls, so 0.5; auto-regressive decode streams weights and KV
# cache and reaches roughly 0.6 of HBM bandwidth; collectives reach roughly 0.7 of link bandwidth.
GPU_EFFICIENCY = {"train": 0.4, "forward": 0.5, "decode": 0.6, "comm": 0.7}
# Fixed cost per collective (small-message all-reduce among 8 NVLink GPUs takes tens of
# microseconds in NCCL's own nccl-tests; assumed 20 us). It is what makes tp=8 decode of a
# small model slower than tp=1: hundreds of tiny all-reduces per generated token.
GPU_OVERHEAD = {"latency": 20e-6}


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind: peak rates (per device), memory, links, and efficiency per work kind."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    memory_bytes: float  # device memory
    memory_bandwidth: float  # bytes/s, device memory (HBM, or DRAM share on CPU)
    intra_node_bandwidth: float  # bytes/s per device to devices of the same node (NVLink)
    inter_node_bandwidth: float  # bytes/s per NODE to other nodes (shared by its devices)
    efficiency: dict[str, float] = field(default_factory=lambda: dict(GPU_EFFICIENCY))
    overhead_s: dict[str, float] = field(default_factory=dict)  # fixed seconds per op call
    physical_cores: int | None = None  # CPU: devices beyond this share cores
    # CPU: busy devices beyond the cores slow each other by (busy / cores) ** oversubscription;
    # 1 = a fair share of the cores, more when ranks that wait on each other time-slice.
    oversubscription: float = 1.0
    bytes_per_param: int = 2  # weights as held for compute (bf16 on GPU, fp32 on CPU)

    def rate(self, kind: str) -> float:
        """Effective FLOP/s (train, forward) or bytes/s (decode, comm) of one device."""
        if kind == "decode":
            return self.memory_bandwidth * self.efficiency["decode"]
        return self.peak_flops * self.efficiency[kind]

    def overhead(self, kind: str) -> float:
        return self.overhead_s.get(kind, 0.0)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column): BFLOAT16 Tensor Core 312 TFLOPS
# (dense; 624 is with sparsity), GPU memory 80 GB HBM2e, memory bandwidth 2,039 GB/s,
# NVLink 600 GB/s. Inter-node: 200 Gbps per node, the cluster of the HybridFlow paper's setup.
A100_80GB = HardwareProfile(
    name="a100-80gb",
    peak_flops=312 * TB,
    memory_bytes=80 * GB,
    memory_bandwidth=2039 * GB,
    intra_node_bandwidth=600 * GB,
    inter_node_bandwidth=200e9 / 8,
    overhead_s=dict(GPU_OVERHEAD),
)

# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): BF16 Tensor Core 1,979 TFLOPS with
# sparsity, so 989 TFLOPS dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s. Inter-node: the
# DGX H100 datasheet's 8 x 400 Gb/s ConnectX-7 compute links = 3.2 Tb/s per node.
H100_SXM = HardwareProfile(
    name="h100",
    peak_flops=989 * TB,
    memory_bytes=80 * GB,
    memory_bandwidth=3350 * GB,
    intra_node_bandwidth=900 * GB,
    inter_node_bandwidth=8 * 400e9 / 8,
    overhead_s=dict(GPU_OVERHEAD),
)

# NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): BF16 Tensor Core 1,979 TFLOPS with
# sparsity (989 dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s. Inter-node as DGX H100/H200:
# 8 x 400 Gb/s per node.
H200_SXM = HardwareProfile(
    name="h200",
    peak_flops=989 * TB,
    memory_bytes=141 * GB,
    memory_bandwidth=4800 * GB,
    intra_node_bandwidth=900 * GB,
    inter_node_bandwidth=8 * 400e9 / 8,
    overhead_s=dict(GPU_OVERHEAD),
)

# A generic 2-core laptop/VM before calibration: ~10 GFLOP/s fp32 per core for small matmuls
# through PyTorch eager, ~5 GB/s of DRAM bandwidth per core, object-store copies at ~1 GB/s.
# These are placeholders of the right order; `calibrate` replaces the efficiencies and overheads
# with values fitted from timings on the machine itself.
CPU = HardwareProfile(
    name="cpu",
    peak_flops=10e9,
    memory_bytes=4 * GB,
    memory_bandwidth=5 * GB,
    intra_node_bandwidth=1 * GB,
    inter_node_bandwidth=0.1 * GB,
    efficiency={"train": 1.0, "forward": 1.0, "decode": 1.0, "comm": 1.0},
    # per call: train = optimizer step, train_micro / forward = micro-batch, decode_step = one
    # generated token, dispatch = the controller's submit + wait of one node, latency = one gloo
    # all-reduce between local processes
    overhead_s={"train": 0.01, "train_micro": 0.02, "forward": 0.01, "decode": 0.005,
                "decode_step": 0.003, "score": 0.005, "score_sample": 1e-5, "advantage": 0.005,
                "dispatch": 0.005, "latency": 1e-3},
    physical_cores=2,
    bytes_per_param=4,
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (A100_80GB, H100_SXM, H200_SXM, CPU)}


def get_profile(name: str | None, device: str = "cpu", base_dir: str | Path = ".") -> HardwareProfile:
    """A built-in profile by name, or one read from a YAML file (e.g. a calibrated profile).

    ``None`` means the default for the device kind: ``cpu``, or ``a100-80gb`` on GPU.
    """
    if name is None:
        name = "cpu" if device == "cpu" else A100_80GB.name
    if name == "cpu":  # this machine's cores
        return replace(CPU, physical_cores=os.cpu_count() or 1)
    if name in PROFILES:
        return PROFILES[name]
    path = Path(name)
    if not path.is_absolute():
        path = Path(base_dir) / path
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return load_profile(path)
    raise ValueError(f"unknown hardware profile {name!r}; built-in: {sorted(PROFILES)} or a .yaml file")


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))


def load_profile(path: str | Path) -> HardwareProfile:
    raw = yaml.safe_load(Path(path).read_text())
    return HardwareProfile(**raw)


# -- model architectures -----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer's shape; parameter and FLOP counts derive from it."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    ffn: int
    vocab: int
    num_kv_heads: int | None = None  # None = multi-head attention (kv heads = heads)
    tied_embeddings: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.num_heads * (self.num_kv_heads or self.num_heads)

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.hidden * 2 + self.hidden * self.kv_dim * 2
        mlp = 3 * self.hidden * self.ffn  # gated MLP: gate, up, down
        return attention + mlp + 2 * self.hidden

    @property
    def num_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings + self.hidden

    def forward_flops(self, num_sequences: float, seq_len: float) -> float:
        """Forward FLOPs for sequences of ``seq_len`` tokens: 2 per parameter-token plus attention."""
        tokens = num_sequences * seq_len
        # QK^T and AV: 2 matmuls x 2 FLOP/MAC x s^2 x hidden per layer and sequence, causal half.
        attention = num_sequences * self.num_layers * 2 * seq_len * seq_len * self.hidden
        return 2 * self.num_params * tokens + attention

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> float:
        return 2 * self.num_layers * self.kv_dim * bytes_per_value


# Llama-architecture configs as published (Llama 2 paper table 1 and the released config.json
# files; 34B as Code Llama 34B): layers, hidden, heads, FFN, vocabulary, KV heads (GQA).
LLAMA: dict[str, ModelArch] = {
    "7b": ModelArch("llama-7b", 32, 4096, 32, 11008, 32000),
    "13b": ModelArch("llama-13b", 40, 5120, 40, 13824, 32000),
    "34b": ModelArch("llama-34b", 48, 8192, 64, 22016, 32000, num_kv_heads=8),
    "70b": ModelArch("llama-70b", 80, 8192, 64, 28672, 32000, num_kv_heads=8),
}


def arch_from_hf_config(config: dict, name: str = "tiny") -> ModelArch:
    """The architecture of a config-built model (the built-in tiny Qwen2 with overrides)."""
    return ModelArch(
        name=name,
        num_layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        num_heads=config["num_attention_heads"],
        ffn=config["intermediate_size"],
        vocab=config.get("vocab_size", 32),
        num_kv_heads=config.get("num_key_value_heads"),
        tied_embeddings=config.get("tie_word_embeddings", False),
    )


def model_size(name: str) -> ModelArch:
    key = name.lower()
    if key not in LLAMA:
        raise ValueError(f"unknown model size {name!r}; expected one of {sorted(LLAMA)}")
    return LLAMA[key]


def with_rates(profile: HardwareProfile, **changes) -> HardwareProfile:
    return replace(profile, **changes)


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b - 1e-12))
