"""What a run prints and records: the iteration line, the memory line, FLOPs, metrics sinks.

The iteration line reproduces Megatron's character for character (users grep it and
compare logs across trainers), leading space included, except that the timestamp
carries microseconds. Skipped and NaN iterations are counted per log interval, as
Megatron does. The
memory line follows Megatron's ``report_memory`` style and can carry extra columns
(graph-pool bytes). Metrics go to a JSONL file (one object per logged iteration, so
tests and tools need no TensorBoard parser) and, when asked, to TensorBoard under
Megatron's scalar names. Formatting is pure and CPU-testable; nothing here owns
process groups.
"""

import datetime
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.transformer.transformer_config import TransformerConfig

# TensorBoard scalar names Megatron uses; callers pass metrics under these keys.
METRIC_NAMES = (
    "lm loss",
    "learning-rate",
    "grad-norm",
    "loss-scale",
    "iteration-time",
    "batch-size",
    "throughput",
    "params-norm",
    "num-zeros",
    "mem-allocated-bytes",
    "mem-max-allocated-bytes",
    "mem-reserved-bytes",
    "mem-max-reserved-bytes",
)

_MB = 1024.0 * 1024.0


def format_iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    lr: float,
    global_batch_size: int,
    losses: Mapping[str, float],
    loss_scale: float,
    grad_norm: float | None,
    num_zeros: float | None = None,
    params_norm: float | None = None,
    skipped_iters: int,
    nan_iters: int,
    throughput_tflops: float | None = None,
    timestamp: datetime.datetime | None = None,
) -> str:
    """Megatron's per-iteration log line.

    Example::

         [2026-11-30 07:37:14.123456] iteration        5/      50 | consumed samples:           40 | ...

    Args:
        iteration: Iterations done so far (1-based count of the one just finished).
        train_iters: Total iterations of the run.
        consumed_samples: Samples consumed so far, over all data-parallel ranks.
        elapsed_ms: Wall time per iteration since the last line, in milliseconds.
        lr: Current learning rate.
        global_batch_size: Samples per optimizer step.
        losses: Loss name (e.g. ``"lm loss"``) -> value averaged since the last line.
        loss_scale: Current loss scale (1.0 without fp16 scaling).
        grad_norm: Global gradient norm; omitted when None (e.g. skipped step).
        num_zeros: Zeros in the gradients; omitted when None.
        params_norm: Parameter L2 norm; omitted when None.
        skipped_iters: Iterations skipped (loss-scale overflow) since the last line.
        nan_iters: Iterations with a NaN loss since the last line.
        throughput_tflops: Model TFLOP/s per GPU; omitted when None.
        timestamp: Time to print; None means now.
    """
    timestamp = timestamp or datetime.datetime.now()
    parts = [
        f"iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    if throughput_tflops is not None:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {throughput_tflops:.1f}")
    parts.append(f"learning rate: {lr:.6E}")
    parts.append(f"global batch size: {global_batch_size:5d}")
    for name, value in losses.items():
        parts.append(f"{name}: {value:.6E}")
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f"num zeros: {num_zeros:.1f}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts.append(f"number of skipped iterations: {skipped_iters:3d}")
    parts.append(f"number of nan iterations: {nan_iters:3d}")
    # Megatron ends every part with " |", so the line ends with one too.
    return " [{}] ".format(timestamp.strftime("%Y-%m-%d %H:%M:%S.%f")) + " ".join(p + " |" for p in parts)


def format_memory_line(
    rank: int,
    name: str,
    allocated_mb: float,
    max_allocated_mb: float,
    reserved_mb: float,
    max_reserved_mb: float,
    extra: Mapping[str, float] | None = None,
) -> str:
    """Megatron-style memory line, e.g. ``[Rank 0] (after 1 iterations) memory (MB) | allocated: 1.00 | ...``.

    Args:
        rank: Global rank printing the line.
        name: What the numbers are for, e.g. ``"(after 1 iterations)"``.
        allocated_mb, max_allocated_mb, reserved_mb, max_reserved_mb: Allocator statistics in MB.
        extra: Further columns in MB (graph pool reserved/live bytes ...), in the given order;
            an ``int`` is a count and prints as one (graphs, pipeline stage).
    """
    parts = [
        f"[Rank {rank}] {name} memory (MB)",
        f"allocated: {allocated_mb:.2f}",
        f"max allocated: {max_allocated_mb:.2f}",
        f"reserved: {reserved_mb:.2f}",
        f"max reserved: {max_reserved_mb:.2f}",
    ]
    parts += [
        f"{key}: {value}" if isinstance(value, int) else f"{key}: {value:.2f}" for key, value in (extra or {}).items()
    ]
    return " | ".join(parts)


def memory_stats_mb(device: torch.device) -> dict[str, float]:
    """Allocator statistics of ``device`` in MB, keyed like ``format_memory_line``'s arguments.

    All zeros for a CPU device (there is no caching allocator to ask).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return {"allocated_mb": 0.0, "max_allocated_mb": 0.0, "reserved_mb": 0.0, "max_reserved_mb": 0.0}
    return {
        "allocated_mb": torch.cuda.memory_allocated(device) / _MB,
        "max_allocated_mb": torch.cuda.max_memory_allocated(device) / _MB,
        "reserved_mb": torch.cuda.memory_reserved(device) / _MB,
        "max_reserved_mb": torch.cuda.max_memory_reserved(device) / _MB,
    }


def memory_metrics(stats_mb: Mapping[str, float]) -> dict[str, float]:
    """``memory_stats_mb`` output -> Megatron's TensorBoard names, in bytes."""
    return {
        "mem-allocated-bytes": stats_mb["allocated_mb"] * _MB,
        "mem-max-allocated-bytes": stats_mb["max_allocated_mb"] * _MB,
        "mem-reserved-bytes": stats_mb["reserved_mb"] * _MB,
        "mem-max-reserved-bytes": stats_mb["max_reserved_mb"] * _MB,
    }


def num_floating_point_operations(
    config: TransformerConfig, *, batch_size: int, seq_length: int, vocab_size: int
) -> float:
    """Model FLOPs of one training iteration (forward + backward) of a dense GPT.

    Counted from the matmul shapes; a matmul ``[m, k] @ [k, n]`` costs ``2 m k n``.
    With ``h`` hidden, ``a`` heads, ``g`` query groups, ``d`` kv channels, ``f`` ffn
    hidden, ``s`` sequence, ``L`` layers, ``V`` vocabulary, the forward cost per token is::

        per layer:  2 * h * (a*d + 2*g*d)      QKV projection (K and V have g groups)
                  + 2 * s * a * d * 2 / 2      scores Q K^T and probabilities @ V, causal: half
                  + 2 * a*d * h                attention output projection
                  + 2 * h * f * (2 if SwiGLU else 1)   fc1 (gate and up for SwiGLU)
                  + 2 * f * h                  fc2
        once:       2 * h * V                  logits

    ``--attention-output-gate`` adds ``2 * h * a*d`` (the gate heads of the QKV projection).
    A gated delta net layer (``--experimental-attention-variant gdn``, ``kh`` key heads of
    ``dk``, ``vh`` value heads of ``dv``, conv of ``c`` taps) has, in place of the attention::

        2 * h * (2*kh*dk + 2*vh*dv + 2*vh)     in-projection (q, k, v, z, beta, alpha)
        + 2 * c * (2*kh*dk + vh*dv)            causal conv
        + 2 * vh * dk * dv * 4                 the rule: state decay-and-update, read (as Megatron)
        + 2 * vh*dv * h                        out-projection

    GDN2 (``gdn2``) has the in-projection ``2 * h * (4*kh*dk + 3*vh*dv)`` (q, k, v, z, f, b, w).

    Training costs 3x the forward (backward computes input and weight gradients).
    Causal attention computes half of the s x s square, and is counted so, as Megatron
    counts it. Total = 3 * batch_size * s * per-token.
    Norms, softmax, activations and the embedding lookup are not counted.

    Args:
        config: Model shape; derived fields need not be finalized.
        batch_size: Sequences per iteration (the global batch size).
        seq_length: Tokens per sequence.
        vocab_size: Padded vocabulary size (the logits width).
    """
    h = config.hidden_size
    a = config.num_attention_heads
    d = config.kv_channels if config.kv_channels is not None else h // a
    g = config.num_query_groups if (config.group_query_attention and config.num_query_groups) else a
    f = config.ffn_hidden_size if config.ffn_hidden_size is not None else 4 * h
    s = seq_length
    fc1_outputs = 2 * f if config.gated_linear_unit else f
    gate = a * d if getattr(config, "attention_output_gate", False) else 0
    attention = (
        2 * h * (a * d + gate + 2 * g * d)  # QKV (and the output gate)
        + 2 * s * a * d  # scores and values: 2 matmuls of 2 * s * a * d each, over half the square
        + 2 * a * d * h  # projection
    )
    mlp = 2 * h * fc1_outputs + 2 * f * h  # fc1, fc2
    linear_layers, linear = _gated_delta_net_layers_and_flops(config)
    per_token = config.num_layers * (attention + mlp) + linear_layers * (linear - attention) + 2 * h * vocab_size
    return 3.0 * batch_size * s * per_token


def _gated_delta_net_layers_and_flops(config) -> tuple[int, int]:
    """``(number of gated delta net layers, forward FLOPs per token of one's attention)``; ``(0, 0)`` without."""
    la = getattr(config, "linear_attention", None)
    if la is None or not la.enabled or la.linear_attention_freq is None:
        return 0, 0
    from megatron.core.ssm.gated_delta_net.config import parse_linear_attention_freq

    pattern = la.linear_attention_pattern or parse_linear_attention_freq(la.linear_attention_freq, config.num_layers)
    h = config.hidden_size
    qk = la.linear_num_key_heads * la.linear_key_head_dim
    v = la.linear_num_value_heads * la.linear_value_head_dim
    flops = (
        2 * h * ((4 * qk + 3 * v) if la.is_gdn2 else (2 * qk + 2 * v + 2 * la.linear_num_value_heads))  # in-proj
        + 2 * la.linear_conv_kernel_dim * (2 * qk + v)  # causal conv
        + 2 * la.linear_num_value_heads * la.linear_key_head_dim * la.linear_value_head_dim * 4  # the rule
        + 2 * v * h  # out-projection
    )
    return sum(pattern), flops


def startup_lines(cfg) -> list[str]:
    """What a run says once at start about how it reads its flags (pure)."""
    lines = []
    if cfg.model.transformer_impl == "transformer_engine":
        lines.append(
            "> --transformer-impl transformer_engine: running the local (plain PyTorch) layers; "
            "the same computation, parameter names as Megatron's local spec"
        )
    if cfg.cuda_graph.cuda_graph_impl == "transformer_engine":
        lines.append(
            "> --cuda-graph-impl transformer_engine: running this trainer's local partial graphs of the same "
            "regions (not Transformer Engine's make_graphed_callables); the same computation"
        )
    moe = cfg.moe
    if moe.enabled and moe.moe_token_dispatcher_type == "flex":
        kernels = {"deepep": "DeepEP's", "hybridep": "HybridEP's", "ncclep": "NCCL EP's"}[moe.flex_backend]
        lines.append(
            f"> --moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend {moe.flex_backend}): running the "
            "alltoall dispatcher; the same tokens, experts, probabilities and combine, moved by torch.distributed "
            f"all-to-all instead of {kernels} kernels"
        )
        sms = [
            flag
            for flag, value in (
                ("--moe-flex-dispatcher-num-sms", moe.moe_flex_dispatcher_num_sms),
                ("--moe-deepep-num-sms", moe.moe_deepep_num_sms),
                ("--moe-hybridep-num-sms", moe.moe_hybridep_num_sms),
            )
            if value is not None
        ]
        if sms:
            lines.append(f"> {' '.join(sms)}: no effect, no flex kernels run here")
        if moe.moe_enable_deepep:
            lines.append("> --moe-enable-deepep is deprecated in Megatron: pass --moe-flex-dispatcher-backend deepep")
    if cfg.ignored_flags:
        lines.append("> accepted with no effect here (speed / I/O knobs): " + " ".join(cfg.ignored_flags))
    if cfg.model.apply_query_key_layer_scaling:
        lines.append("> --apply-query-key-layer-scaling: no effect, the softmax runs in fp32 where the scalings cancel")
    text = cfg.parallel.pipeline_model_parallel_layout
    if text is not None:
        from megatron.core.pipeline_parallel.layout_string import check_stages, describe

        pp = cfg.parallel.pipeline_model_parallel_size
        lines.append(f"> --pipeline-model-parallel-layout {text}, model chunks in order:")
        lines += [f">   {line}" for line in describe(check_stages(text, pp), pp)]
    return lines


def count_zeros(tensors) -> int:
    """Number of exact zeros over the given tensors (``--log-num-zeros-in-grad``)."""
    total = 0
    for t in tensors:
        if t is not None:
            total += int((t == 0).sum().item())
    return total


def throughput_tflops_per_gpu(flops_per_iteration: float, elapsed_s: float, world_size: int) -> float:
    """Model TFLOP/s per GPU, as in Megatron's ``throughput per GPU`` column."""
    return flops_per_iteration / (elapsed_s * 1e12 * world_size)


def _make_summary_writer(log_dir: str):
    """A TensorBoard ``SummaryWriter``; module-level so tests can replace it."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir, max_queue=1000)


def _check_tensorboard_installed() -> None:
    try:
        import tensorboard  # noqa: F401 - only probing
    except ImportError:
        raise ValueError(
            "--tensorboard-dir needs the tensorboard package: pip install tensorboard "
            "(or drop --tensorboard-dir and use --metrics-file for JSONL metrics)."
        ) from None


def _import_wandb():
    """The wandb module; module-level so tests can replace it."""
    try:
        import wandb
    except ImportError:
        raise ValueError(
            "--wandb-project needs the wandb package: pip install wandb (or drop --wandb-project and use "
            "--tensorboard-dir or --metrics-file)."
        ) from None
    return wandb


def wandb_settings(cfg, run_config: dict[str, Any]) -> dict[str, Any] | None:
    """``wandb.init`` keyword arguments from the --wandb-* flags (Megatron's), or None without --wandb-project.

    ``run_config`` is the run's config as plain nested dicts (``checkpoint_config.config_to_dict``).
    """
    lg = cfg.logging
    if not lg.wandb_project:
        return None
    settings = {
        "dir": lg.wandb_save_dir or os.path.join(cfg.checkpoint.save, "wandb"),
        "name": lg.wandb_exp_name,
        "project": lg.wandb_project,
        "config": run_config,
    }
    if lg.wandb_entity:
        settings["entity"] = lg.wandb_entity
    return settings


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


class MetricsWriter:
    """Appends metrics to a JSONL file and, optionally, TensorBoard.

    Keys are Megatron's TensorBoard names (``METRIC_NAMES``) or any other name; the
    JSONL object holds them as given plus ``"iteration"`` (and ``"samples"`` when
    passed). Non-finite floats are written as JSON ``NaN``/``Infinity``, which Python's
    ``json`` reads back; a NaN loss is worth seeing. An existing file whose last line was
    torn (a crash or a full disk mid-write) is repaired on open: the partial line is
    dropped, with a message, so the resumed run's first record starts a line of its own.

    Args:
        path: JSONL file to append to, or None.
        tensorboard_dir: TensorBoard log folder, or None.
        enabled_on_this_rank: Only this rank writes (Megatron: the last rank). Every
            rank still checks that tensorboard (and wandb) is importable, so a missing
            package fails the whole run at start, not one rank mid-run.
        wandb: ``wandb.init`` keyword arguments (``wandb_settings``), or None. W&B gets
            the records TensorBoard gets.

    Raises:
        ValueError: ``tensorboard_dir`` or ``wandb`` is set but its package is missing, or
            a path names a file where a folder belongs (or the reverse).
    """

    def __init__(
        self,
        path: str | None,
        tensorboard_dir: str | None,
        *,
        enabled_on_this_rank: bool,
        wandb: dict[str, Any] | None = None,
    ):
        if tensorboard_dir is not None:
            if os.path.exists(tensorboard_dir) and not os.path.isdir(tensorboard_dir):
                raise ValueError(
                    f"--tensorboard-dir {tensorboard_dir} is a file, not a folder; point it at a folder "
                    "(created if missing)."
                )
            _check_tensorboard_installed()
        if path is not None and os.path.isdir(path):
            raise ValueError(f"--metrics-file {path} is a folder; give a file path, e.g. {path}/metrics.jsonl.")
        wandb_module = _import_wandb() if wandb is not None else None
        self.enabled = enabled_on_this_rank
        self._file = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        if path is not None:
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            repair_jsonl_tail(path)
            self._file = open(path, "a", encoding="utf-8")
        if tensorboard_dir is not None:
            self._tb = _make_summary_writer(tensorboard_dir)
        if wandb_module is not None:
            os.makedirs(wandb["dir"], exist_ok=True)
            wandb_module.init(**wandb)
            self._wandb = wandb_module

    @property
    def has_scalar_sink(self) -> bool:
        """Whether this rank writes scalars to TensorBoard or W&B (the JSONL file aside)."""
        return self._tb is not None or self._wandb is not None

    def write(
        self,
        iteration: int,
        metrics: Mapping[str, Any],
        *,
        samples: int | None = None,
        jsonl: bool = True,
        tensorboard: bool = True,
    ) -> None:
        """Records one iteration's metrics.

        Args:
            iteration: Iteration number.
            metrics: Name -> number (floats, ints or one-element tensors). None values
                go to JSONL as null and are skipped in TensorBoard.
            samples: Consumed samples; adds ``"<name> vs samples"`` scalars.
            jsonl, tensorboard: Which sinks get this record.
        """
        if not self.enabled:
            return
        values = {name: _jsonable(value) for name, value in metrics.items()}
        if self._file is not None and jsonl:
            record = {"iteration": iteration}
            if samples is not None:
                record["samples"] = samples
            record.update(values)
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None and tensorboard:
            for name, value in values.items():
                if value is None:
                    continue
                self._tb.add_scalar(name, value, iteration)
                if samples is not None:
                    self._tb.add_scalar(f"{name} vs samples", value, samples)
            self._tb.flush()
        if self._wandb is not None and tensorboard:
            scalars = {name: value for name, value in values.items() if value is not None}
            if samples is not None:
                scalars["samples"] = samples
            self._wandb.log(scalars, step=iteration)

    def close(self) -> None:
        """Closes the file, the TensorBoard writer and the W&B run. Safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def repair_jsonl_tail(path: str) -> int:
    """Drops a torn last line of a JSONL file (one not ended by a newline).

    A last line that is complete JSON only lacking its newline gets the newline instead.

    Returns:
        The number of bytes dropped (0 when the file was whole or missing).
    """
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    if size == 0:
        return 0
    with open(path, "r+b") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # Find the start of the last line, reading backwards in blocks.
        end, start = size, 0
        block = 1 << 16
        pos = size
        while pos > 0:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            i = chunk.rfind(b"\n")
            if i >= 0:
                start = pos + i + 1
                break
        f.seek(start)
        tail = f.read(end - start)
        try:
            json.loads(tail.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            f.truncate(start)
            print(
                f"WARNING: {path} ended in a torn line ({end - start} bytes, from a crash or a full disk); "
                "dropped it before appending.",
                flush=True,
            )
            return end - start
        f.seek(end)
        f.write(b"\n")
        return 0


def _rank_and_world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def print_rank_0(message: str) -> None:
    """Prints on global rank 0 only (every process when not distributed)."""
    rank, _ = _rank_and_world()
    if rank == 0:
        print(message, flush=True)


def print_last_rank(message: str) -> None:
    """Prints on the last rank only, where Megatron prints the iteration line."""
    rank, world = _rank_and_world()
    if rank == world - 1:
        print(message, flush=True)
