"""The CUDA-graph benchmark's configurations, run plan, FLOP count and matmul peak.

``graph_bench.py`` runs the benchmark (one child process per run, the table); this file
says what it runs: the configs (``small``, ``launch`` = ``launch16``, ``dense8``,
``medium``, ``moe``, ``hybrid``), each with its own list of modes (eager, our partial
graphs per scope, ``torch.cuda.make_graphed_callables`` where it applies), extra flags a
mode needs (``local:moe`` graphs the whole MoE block, which needs drop-and-pad, so it is
measured against an eager run with the same flags, ``eager:drop-and-pad``), a rough
duration per run for the plan printed up front, the model FLOPs of MoE and hybrid
models, and the bf16 matmul peak that MFU is measured against.

Usage: ``python tools/graph_bench.py --configs moe hybrid --out DIR`` (see ``--help``);
``--dry-run`` prints the plan only.
"""

import time

CONFIGS = {
    # A few small layers: host-bound, where graphs pay most per kernel.
    "small": "--num-layers 3 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 2",
    # A launch-bound config: many small kernels.
    "launch16": "--num-layers 16 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 8 "
    "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 1",
    # 8 layers, hidden 1024, seq 2048: the config upstream Megatron's local graphs were measured on.
    "dense8": "--num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2",
    # A 1.3B-class GPT: device-bound.
    "medium": "--num-layers 24 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 "
    "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 1 "
    "--position-embedding-type rope --swiglu --normalization RMSNorm",
    "moe": "--num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2 "
    "--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --swiglu --disable-bias-linear",
    "hybrid": "--hybrid-layer-pattern M*M-M*M- --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2",
}
CONFIGS["launch"] = CONFIGS["launch16"]

DENSE_MODES = [
    "eager", "eager:expandable", "eager:fold", "lean", "local:layer", "local:attn", "noturn:attn", "local:mlp",
    "noturn:mlp", "local:attn+mlp",
    "full", "mgc",
]  # fmt: skip
"""``local:*`` runs with the eager turns' default (every turn); ``noturn:*`` without any, ``turn:*``
with the first only (``MEGATRON_CG_EAGER_TURN``). ``scan32:*`` (hybrid) slices the eager Mamba scans
of a graphed run at the captured budget (``MEGATRON_CG_TURN_SCAN_BUDGET=captured``); ``torchscan:*`` runs
the mode with the scan on PyTorch instead of its Triton kernels, against ``torchscan:eager``. ``eager:fold``
is eager with DDP folding each gradient into main_grad on arrival (one add per parameter), as the
trainer does wherever turns may open, instead of one multi-tensor fold after the backward: that part
of a turn's host cost."""
MODES = {
    "small": DENSE_MODES,
    "launch16": DENSE_MODES,
    "launch": DENSE_MODES,
    "dense8": DENSE_MODES,
    # lean_gpt.py has learned positions, LayerNorm and GeLU only: no lean row for medium.
    "medium": ["eager", "local:layer", "local:attn", "local:mlp", "local:attn+mlp", "mgc"],
    # No mgc row for MoE: a dropless MoE layer reads its token counts on the host.
    "moe": [
        "eager",
        "local:attn+moe_router+moe_preprocess",
        "local:moe_router+moe_preprocess",
        "local:attn",
        "eager:drop-and-pad",
        "local:moe",
    ],
    "hybrid": [
        "eager",
        "local:mamba",
        "noturn:mamba",
        "local:attn",
        "scan32:attn",
        "local:mlp",
        "scan32:mlp",
        "local:layer",
        "mgc",
        "torchscan:eager",
        "torchscan:local:mamba",
        "torchscan:local:attn",
        "torchscan:local:mlp",
        "torchscan:local:layer",
    ],  # fmt: skip
}
DROP_AND_PAD = "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity"
MODE_FLAGS = {("moe", "local:moe"): DROP_AND_PAD, ("moe", "eager:drop-and-pad"): DROP_AND_PAD}
TORCH_SCAN = "torchscan:"
"""A mode's prefix that runs it with the Mamba scan on PyTorch (``MEGATRON_SSD_KERNELS=torch``), not on
its Triton kernels (the default)."""
BASELINE = {("moe", "local:moe"): "eager:drop-and-pad"}
"""The eager mode a graphed mode is compared with, where it is not ``eager``."""

SECONDS_PER_RUN = {"small": 20, "launch16": 25, "launch": 25, "dense8": 30, "medium": 75, "moe": 45, "hybrid": 60}
"""Rough wall time of one run (process start, build, iterations, teardown) on an H200."""


def modes_for(config: str, wanted=None) -> list[str]:
    """The modes run for ``config``: its list, or the ``wanted`` ones that apply to it."""
    own = MODES[config]
    return list(own) if wanted is None else [m for m in wanted if m in own]


def mode_extra(config: str, mode: str) -> str:
    return MODE_FLAGS.get((config, mode), "")


def baseline_mode(config: str, mode: str) -> str:
    if mode.startswith(TORCH_SCAN):  # a run on the PyTorch scan against eager on it
        return TORCH_SCAN + "eager"
    return BASELINE.get((config, mode), "eager")


def plan(configs, wanted_modes, repeat: int) -> list[tuple[int, str, str]]:
    """``(repeat index, config, mode)`` in run order: round robin over configs and modes."""
    runs = []
    for rep in range(repeat):
        for config in configs:
            runs += [(rep, config, mode) for mode in modes_for(config, wanted_modes)]
    return runs


def describe_plan(runs) -> str:
    seconds = sum(SECONDS_PER_RUN.get(config, 60) for _, config, _ in runs)
    per_config: dict[str, int] = {}
    for _, config, _ in runs:
        per_config[config] = per_config.get(config, 0) + 1
    parts = ", ".join(f"{c} {n}" for c, n in per_config.items())
    return f"{len(runs)} runs ({parts}); about {seconds / 60:.1f} min at the usual time per run"


def model_flops(cfg) -> float:
    """Model FLOPs of one iteration: Megatron's dense count, with MoE layers' MLPs counted
    as top-k experts (+ shared experts, + the router GEMM), and the hybrid count for a
    ``--hybrid-layer-pattern`` model."""
    from megatron.training import logging_utils as logs

    m, t = cfg.model, cfg.training
    batch, seq, vocab = t.global_batch_size, m.seq_length, m.vocab_size
    if cfg.mamba.hybrid_layer_pattern is not None:
        from megatron.core.models.hybrid.hybrid_model import num_floating_point_operations

        return num_floating_point_operations(m, cfg.mamba, batch, seq, vocab)
    total = logs.num_floating_point_operations(m, batch_size=batch, seq_length=seq, vocab_size=vocab)
    moe = cfg.moe
    if not moe.enabled:
        return total
    h = m.hidden_size

    def mlp(f: int) -> int:  # per-token forward FLOPs of fc1 + fc2
        return 2 * h * (2 * f if m.gated_linear_unit else f) + 2 * f * h

    per_token = moe.moe_router_topk * mlp(moe.moe_ffn_hidden_size or m.ffn_hidden_size) + 2 * h * moe.num_moe_experts
    if moe.moe_shared_expert_intermediate_size:
        per_token += mlp(moe.moe_shared_expert_intermediate_size)
    n_moe = sum(moe.moe_layer_pattern)
    return total + 3.0 * batch * seq * n_moe * (per_token - mlp(m.ffn_hidden_size))


def matmul_peak_tflops(n: int = 8192, iters: int = 40, rounds: int = 3) -> float:
    """The bf16 ``torch.matmul`` rate of this GPU now, in TFLOP/s (the best of ``rounds``)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        torch.matmul(a, b, out=c)
    best = 0.0
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        best = max(best, 2.0 * n**3 * iters / (time.perf_counter() - start) / 1e12)
    del a, b, c
    torch.cuda.empty_cache()
    return best


def add_mfu(rows, peak_tflops: float | None) -> None:
    """Sets ``matmul_peak_tflops`` and ``mfu`` (TFLOP/s per GPU / peak) on every row."""
    for r in rows:
        r["matmul_peak_tflops"] = peak_tflops
        r["mfu"] = r["tflops_per_gpu"] / peak_tflops if peak_tflops else None
