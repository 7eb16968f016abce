"""Megatron's optimizer param groups: which group a parameter joins and that group's hyper-parameters.

Weight decay off for biases and 1-D params, ``--decoupled-lr`` for the embedding and output
layer, and muP's per-group lr (and Adam eps) scaling (``--use-mup``).
"""

from collections.abc import Callable
from typing import Any

import torch

from megatron.core.optimizer.muon import uses_muon


def _uses_weight_decay(param: torch.Tensor) -> bool:
    """Megatron's rule: biases and other 1-D params (norm weights) get no weight decay."""
    return param.ndim >= 2


GroupKey = tuple[bool, ...]
"""A parameter's optimizer group: (gets weight decay, uses --decoupled-lr, muP-scaled lr), and with
--optimizer muon a fourth element: orthogonalized by Muon (else stepped by Adam)."""

GROUP_ORDER: tuple[GroupKey, ...] = (
    (True, False, False),
    (False, False, False),
    (True, True, False),
    (False, True, False),
    (True, False, True),
    (False, False, True),
)
"""The order of the param groups (and of a non-distributed state dict's parameters)."""


def group_order(config) -> tuple[GroupKey, ...]:
    """``GROUP_ORDER``; with --optimizer muon the Muon groups first, then the Adam ones."""
    if getattr(config, "optimizer", None) != "muon":
        return GROUP_ORDER
    return tuple(key + (True,) for key in GROUP_ORDER) + tuple(key + (False,) for key in GROUP_ORDER)


def default_group(param: torch.Tensor) -> GroupKey:
    """The group without a model to name params by: 2-D and larger ones decay."""
    return _uses_weight_decay(param), False, False


def _model_config(module: torch.nn.Module):
    """The model's ``TransformerConfig`` (the first submodule that carries one), or None."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "use_mup"):
            return config
    return None


def param_group_rule(module: torch.nn.Module, config) -> Callable[[torch.Tensor], GroupKey]:
    """Megatron's param-group rule for the parameters of ``module``, by name.

    No weight decay for 1-D parameters and biases, except (``--apply-wd-to-qk-layernorm``)
    the q/k layernorm ones; with ``--decoupled-lr`` the input embedding and the output
    layer weights form groups of their own; with ``--optimizer muon`` Muon's parameters
    (``muon.uses_muon``) and Adam's are in separate groups. With ``--use-mup`` (width multiplier m != 1)
    the lr of some params is scaled (``group_settings``): with Adam the hidden matrices
    (2-D and larger, not embeddings or the output layer), with SGD the vector-like params
    (1-D ones, embeddings, the output layer) except those on --decoupled-lr.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    qk = bool(getattr(config, "apply_wd_to_qk_layernorm", False))
    decoupled = getattr(config, "decoupled_lr", None) is not None
    model_config = _model_config(module)
    mup = model_config is not None and model_config.use_mup and model_config.mup_width_mult != 1.0
    sgd = getattr(config, "optimizer", "adam") == "sgd"
    muon = getattr(config, "optimizer", None) == "muon"

    def group_of(param: torch.Tensor) -> GroupKey:
        name = names.get(id(param), "")
        decays = not (param.ndim < 2 or name.endswith(".bias"))
        if qk and ("q_layernorm." in name or "k_layernorm." in name):
            decays = True
        embedding_or_output = name.endswith("embedding.word_embeddings.weight") or name.endswith("output_layer.weight")
        on_decoupled = decoupled and embedding_or_output
        scaled = False
        if mup and not on_decoupled:
            # muP's embedding class: every embedding parameter and the output layer weight.
            vector_like = param.ndim <= 1 or ".embedding." in f".{name}" or name.endswith("output_layer.weight")
            scaled = vector_like if sgd else not vector_like
        if muon:
            return decays, on_decoupled, scaled, uses_muon(name, param)
        return decays, on_decoupled, scaled

    return group_of


def group_settings(key: GroupKey, config, mup_width_mult: float = 1.0) -> dict[str, Any]:
    """The hyper-parameters of one param group: weight decay, the lr range for --decoupled-lr or muP.

    A muP-scaled group (``key[2]``) runs with Adam at lr / m, min lr / m and eps / m, with
    SGD at lr * m and min lr * m, as Megatron's muP optimizer overrides.
    """
    decays, decoupled, mup_scaled = key[:3]
    # wd_mult: the share of the scheduled weight decay (--weight-decay-incr-style) the group takes.
    settings: dict[str, Any] = {"weight_decay": config.weight_decay if decays else 0.0, "wd_mult": float(decays)}
    if len(key) > 3:
        settings["use_muon"] = key[3]
    if decoupled:
        settings["max_lr"] = config.decoupled_lr
        settings["min_lr"] = config.decoupled_min_lr if config.decoupled_min_lr is not None else config.min_lr
    mult = 1.0
    if mup_scaled and not decoupled:
        mult = mup_width_mult if config.optimizer == "sgd" else 1.0 / mup_width_mult
        settings["max_lr"] = config.lr * mult
        settings["min_lr"] = config.min_lr * mult
    if config.optimizer == "adam":
        settings["eps"] = config.adam_eps * mult
    return settings


def mup_width_mult_of(module: torch.nn.Module) -> float:
    """The muP width multiplier of the model in ``module`` (1.0 without muP)."""
    model_config = _model_config(module)
    return model_config.mup_width_mult if model_config is not None and model_config.use_mup else 1.0
