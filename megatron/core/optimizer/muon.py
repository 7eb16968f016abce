"""Muon (``--optimizer muon``): orthogonalized momentum on hidden weight matrices, a scalar optimizer elsewhere.

Megatron's split: a parameter is a *Muon* parameter when it is a 2-D weight that is
neither the word embedding nor the output layer and is not marked ``use_muon = False``
(Mamba's ``in_proj``); everything else (1-D norm weights, biases, embeddings, the
output layer) is stepped by the ``--muon-scalar-optimizer``: AdamW with the Adam flags
(``adam``) or Lion with ``--lion-beta1`` / ``--lion-beta2`` (``lion``, ``lion.py``), both
with decoupled weight decay. Stacked expert weights ``[experts, out, in]`` are one matrix
per expert, as Megatron's per-expert weights.

One Muon update of a weight ``W`` with gradient ``G`` (fp32 main params, after clipping):
``W <- W - lr * wd * W`` (decoupled weight decay), ``M <- M + (1 - mu) (G - M)``,
``U = G + mu (M - G)`` with ``--muon-nesterov`` else ``U = M``, and
``W <- W - lr * s * NS(U)`` where ``NS`` is the Newton-Schulz orthogonalization
(``newton_schulz.py``) and ``s`` the ``--muon-scale-mode`` factor of the whole
matrix's shape times ``--muon-extra-scale-factor``. With ``--muon-split-qkv`` (the
default) the query, key and value rows of each fused QKV weight are orthogonalized
separately (gated attention: query, gate, key, value).

``Muon`` is one ``torch.optim.Optimizer`` over both kinds of parameter groups (a
group's ``use_muon`` says which), so its state dict indexes every parameter in group
order as a single optimizer's does. The other groups are stepped by an inner
``torch.optim.AdamW`` or ``Lion`` that shares this optimizer's state and group dicts.

Newton-Schulz needs whole matrices: the optimizer asks ``assemble`` for each Muon
parameter's input as the whole (TP-local) matrix. Without the distributed optimizer
that is the tensor itself; with it, the shards are all-gathered over data-parallel
ranks (``DistributedOptimizer``). Tensor-parallel shards follow ``--muon-tp-mode``, over
the TP group for dense weights and over the expert-TP group for expert weights split by
``--expert-tensor-parallel-size`` (each expert's shard of ``[experts, out, in]`` on its own).
"""

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron.core.config_utils import require
from megatron.core.optimizer.lion import check_betas, lion_from_config
from megatron.core.optimizer.newton_schulz import check_coefficients, newton_schulz_tp, scale_factor


def validate_muon(config, precision) -> None:
    """Megatron's checks of the Muon flags (``OptimizerConfig``, ``PrecisionConfig``); raises ``ValueError``."""
    require(not precision.fp16, "--optimizer muon does not support --fp16 (as in Megatron); use --bf16.")
    if config.muon_scalar_optimizer == "lion":
        check_betas(config.lion_beta1, config.lion_beta2)
    require(
        config.muon_fp32_matmul_prec in ("medium", "high"),
        f"--muon-fp32-matmul-prec {config.muon_fp32_matmul_prec}: torch has no such float32 matmul precision "
        "(Megatron fails at its first step); use medium or high.",
    )
    check_coefficients(config.muon_coefficient_type, config.muon_num_ns_steps)


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: 2-D weights (stacked ``[experts, out, in]`` expert weights: per expert), except
    biases, the word embedding, the output layer and parameters marked ``use_muon = False``."""
    if not getattr(param, "use_muon", True) or name.endswith(".bias"):
        return False
    if name.endswith("embedding.word_embeddings.weight") or name.endswith("output_layer.weight"):
        return False
    return param.ndim == 2 or (param.ndim == 3 and bool(getattr(param, "is_expert", False)))


@dataclasses.dataclass(frozen=True)
class MatrixInfo:
    """How to orthogonalize one Muon parameter.

    Attributes:
        shape: The model parameter's (TP-local) shape: ``(out, in)`` or ``(experts, out, in)``.
        qkv_split: Rows of query, (gate,) key and value per query group of a fused QKV weight, or None.
        partition_dim: Matrix dimension (0 rows, 1 columns) split over ``tp_group``, or None.
        tp_group: The tensor-parallel group of a split weight.
        tp_size: Its size.
    """

    shape: tuple[int, ...]
    qkv_split: tuple[int, ...] | None = None
    partition_dim: int | None = None
    tp_group: Any = None
    tp_size: int = 1


def matrix_infos(modules: Sequence[torch.nn.Module], pg, config) -> dict[int, MatrixInfo]:
    """``id(param) -> MatrixInfo`` of every Muon parameter of ``modules`` (an ``OptimizerConfig``'s flags)."""
    qkv_rows = {}
    for module in modules:
        for sub in module.modules():
            qkv = getattr(sub, "linear_qkv", None)
            if qkv is not None and hasattr(sub, "heads_per_group") and hasattr(sub, "kv_channels"):
                q = sub.heads_per_group * sub.kv_channels
                kv = sub.kv_channels
                parts = (q, q, kv, kv) if getattr(sub, "output_gate", False) else (q, kv, kv)
                qkv_rows[id(qkv.weight)] = parts
    infos = {}
    for module in modules:
        for name, param in module.named_parameters():
            if not param.requires_grad or not uses_muon(name, param):
                continue
            split = qkv_rows.get(id(param)) if config.muon_split_qkv else None
            if split is not None and param.shape[0] % sum(split):
                split = None  # Megatron skips a QKV weight whose rows are not whole groups
            group, size = _tp_group_of(param, pg)
            partition = None
            if size > 1 and getattr(param, "tensor_model_parallel", False):
                partition = getattr(param, "partition_dim", None)
                assert partition is not None, f"{name} is split over tensor parallelism but has no partition_dim"
                if partition == -1:  # Megatron's "not split"
                    partition = None
                else:
                    partition -= param.ndim - 2  # stacked experts [experts, out, in]: a dim of each matrix
            infos[id(param)] = MatrixInfo(
                tuple(param.shape),
                None if split is None else tuple(split),
                partition,
                group if partition is not None else None,
                size if partition is not None else 1,
            )
    return infos


def _tp_group_of(param: torch.Tensor, pg) -> tuple[Any, int]:
    """The group a parameter's TP shards span and its size: expert-TP for expert weights, else TP."""
    if pg is None:
        return None, 1
    if getattr(param, "is_expert", False):
        return getattr(pg, "expt_tp", None), getattr(pg, "expt_tp_size", 1)
    return getattr(pg, "tp", None), getattr(pg, "tp_size", 1)


def orthogonalize(update: torch.Tensor, info: MatrixInfo, config) -> torch.Tensor:
    """The scaled orthogonalized update of one Muon parameter (``update`` shaped ``info.shape``)."""
    if info.qkv_split is None:
        return _scaled_orthogonal(update, info, config)
    *batch, rows, cols = update.shape
    per_group = sum(info.qkv_split)
    groups = update.reshape(*batch, rows // per_group, per_group, cols)
    parts = []
    for part in torch.split(groups, list(info.qkv_split), dim=-2):
        matrix = part.reshape(*batch, -1, cols)
        parts.append(_scaled_orthogonal(matrix, info, config).reshape(part.shape))
    return torch.cat(parts, dim=-2).reshape(update.shape)


def _scaled_orthogonal(matrix: torch.Tensor, info: MatrixInfo, config) -> torch.Tensor:
    partition = None if config.muon_tp_mode == "blockwise" else info.partition_dim
    size = [matrix.size(-2), matrix.size(-1)]
    if partition is not None:
        size[partition] *= info.tp_size  # the scale of the whole matrix
    orth = newton_schulz_tp(
        matrix.contiguous(),
        config.muon_num_ns_steps,
        config.muon_coefficient_type,
        group=info.tp_group,
        partition_dim=partition,
        mode=config.muon_tp_mode,
        bf16=config.muon_fp32_matmul_prec == "medium",
    )
    return orth * (scale_factor(size[0], size[1], config.muon_scale_mode) * config.muon_extra_scale_factor)


Assemble = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], list[tuple[torch.Tensor, int, int]]]
"""``[(main, update piece)] -> [(whole update matrix, start, end)]``: the flat range of the whole matrix
that ``main`` holds."""


def _whole(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, int, int]]:
    return [(update, 0, update.numel()) for _main, update in pairs]


def scalar_state_names(config) -> list[str]:
    """The state the ``--muon-scalar-optimizer`` keeps per tensor once stepped."""
    return ["exp_avg"] if config.muon_scalar_optimizer == "lion" else ["step", "exp_avg", "exp_avg_sq"]


def check_saved_scalar(groups: list[dict], config) -> None:
    """Raises ``ValueError`` when a saved state dict's scalar groups are the other scalar optimizer's
    (their hyper-parameters and moments would be taken for this one's)."""
    for group in groups:
        if group.get("use_muon", True):
            continue
        saved = "adam" if "eps" in group else "lion"
        if saved != config.muon_scalar_optimizer:
            raise ValueError(
                f"the checkpoint's optimizer state was saved with --muon-scalar-optimizer {saved}, this run has "
                f"{config.muon_scalar_optimizer}: pass --muon-scalar-optimizer {saved}, or --no-load-optim to start "
                "the optimizer afresh."
            )


def adamw_kwargs(config) -> dict:
    """``torch.optim.AdamW``'s keyword arguments from the run's flags (lr, betas, eps, weight decay)."""
    return dict(
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )


def _build_scalar(groups: list[dict], config) -> torch.optim.Optimizer:
    """The ``--muon-scalar-optimizer`` over ``groups``: AdamW or Lion."""
    if config.muon_scalar_optimizer == "lion":
        return lion_from_config(groups, config)
    # foreach, not fused: the step reads the skip flag on the host (see MixedPrecisionOptimizer.step).
    return torch.optim.AdamW(groups, foreach=True, **adamw_kwargs(config))


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon``, the scalar optimizer (AdamW or Lion) on the others; one
    optimizer's state dict.

    Args:
        groups: Param groups (``params``, ``weight_decay``, ``use_muon``, optional lr range).
        config: ``OptimizerConfig``.
        info_of: ``main tensor -> MatrixInfo`` for the Muon tensors.
        assemble: See ``Assemble``; default: each tensor is its whole matrix.

    Attributes:
        scalar: The inner optimizer of the groups without ``use_muon`` (None when there are none).
    """

    def __init__(self, groups: list[dict], *, config, info_of: Callable[[torch.Tensor], MatrixInfo], assemble=None):
        muon = [g for g in groups if g["use_muon"]]
        others = [g for g in groups if not g["use_muon"]]
        if not muon:
            raise ValueError("--optimizer muon found no 2-D hidden weight to orthogonalize; use --optimizer adam.")
        self.config = config
        self.info_of = info_of
        self.assemble: Assemble = assemble or _whole
        defaults = dict(
            lr=config.lr,
            weight_decay=config.weight_decay,
            momentum=config.muon_momentum,
            nesterov=config.muon_nesterov,
        )
        super().__init__(muon, defaults)
        self.scalar = _build_scalar(others, self.config) if others else None
        self.param_groups = list(groups)  # the given order, the same dicts
        self._link()

    def _link(self) -> None:
        if self.scalar is not None:
            self.scalar.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.scalar.state = self.state

    def state_names_for(self, group: dict) -> list[str]:
        """The state a tensor of ``group`` holds once stepped."""
        return ["momentum_buffer"] if group["use_muon"] else scalar_state_names(self.config)

    def group_template(self, use_muon: bool) -> dict:
        """The hyper-parameters (no ``params``) of a group of the given kind, from a live group when one exists."""
        for group in self.param_groups:
            if group["use_muon"] == use_muon:
                return {k: v for k, v in group.items() if k != "params"}
        if use_muon:
            return dict(self.defaults, use_muon=True)
        probe = _build_scalar([torch.zeros(1)], self.config)
        return {k: v for k, v in probe.param_groups[0].items() if k != "params"} | {"use_muon": False}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the scalar optimizer pointed at the new group dicts and state."""
        check_saved_scalar(state_dict["param_groups"], self.config)
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        """One step of the scalar optimizer's groups and one Muon step of the Muon groups."""
        if closure is not None:
            raise ValueError("Muon.step takes no closure.")
        if self.scalar is not None:
            self.scalar.step()
        pending = []
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            lr, mu = group["lr"], group["momentum"]
            for main in group["params"]:
                if main.grad is None:
                    continue
                grad = main.grad
                state = self.state[main]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(main)
                if group["weight_decay"] != 0.0:
                    main.add_(main, alpha=-group["weight_decay"] * lr)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - mu)
                update = grad.lerp(buf, mu) if group["nesterov"] else buf.clone()
                pending.append((main, update, lr))
        precision = "high" if self.config.muon_fp32_matmul_prec == "high" else torch.get_float32_matmul_precision()
        with _matmul_precision(precision):
            wholes = self.assemble([(main, update) for main, update, _ in pending])
            for (main, _update, lr), (whole, start, end) in zip(pending, wholes):
                info = self.info_of(main)
                orth = orthogonalize(whole.reshape(info.shape), info, self.config)
                main.add_(orth.reshape(-1)[start:end].view_as(main), alpha=-lr)
        return None


@contextlib.contextmanager
def _matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
