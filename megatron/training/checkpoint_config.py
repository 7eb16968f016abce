"""The run config as a checkpoint stores it, and the check of a loaded one against the run.

A checkpoint holds the saving run's ``RunConfig`` as plain nested dicts
(``config_to_dict``: str/int/float/bool/None/list/dict only, so the file loads with
``torch.load(weights_only=True)``). At load, ``check_config`` compares the fields that
decide parameter shapes or how weights are used, before any tensor is touched, and names
every differing field with its flag; ``check_expert_form`` refuses a torch-format file
whose experts are in the other module form (``--moe-grouped-gemm``).
"""

import dataclasses
import enum
from typing import Any

import torch

# Model fields that decide parameter shapes or how the weights are used. A checkpoint
# saved with other values cannot be loaded (or would silently compute something else).
MODEL_CHECK_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "position_embedding_type",
    "normalization",
    "gated_linear_unit",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
)
PARALLEL_CHECK_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")

# Flags spelled differently from their field, for error messages.
_FLAG_NAMES = {
    "gated_linear_unit": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "vocab_size": "the tokenizer / --vocab-size / --make-vocab-size-divisible-by; padded to a multiple of "
    "--make-vocab-size-divisible-by x --tensor-model-parallel-size",
    "num_query_groups": "--num-query-groups / --group-query-attention",
    "num_moe_experts": "--num-experts",
}


def _plain(value: Any) -> Any:
    """Config value -> str/int/float/bool/None/list/dict (what weights_only can load)."""
    if isinstance(value, enum.Enum):  # first: IntEnum/StrEnum are ints/strs too
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value)(value) if value is not None else None  # plain builtin, not a subclass
    if isinstance(value, torch.dtype):
        return str(value)  # "torch.bfloat16"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return config_to_dict(value)
    return str(value)


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass (e.g. ``RunConfig``) as nested plain dicts, one per concern."""
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def check_config(saved: dict[str, Any], cfg, path: str) -> None:
    """Raises ``ValueError`` if the checkpoint's model shape differs from this run's.

    Args:
        saved: The checkpoint's ``config`` entry (``config_to_dict`` of the saving run).
        cfg: This run's ``RunConfig`` (validated, vocab size set).
        path: The checkpoint file, for the message.
    """
    current = config_to_dict(cfg)
    diffs = []
    checks = [("model", n) for n in MODEL_CHECK_FIELDS] + [("parallel", n) for n in PARALLEL_CHECK_FIELDS]
    checks.append(("moe", "num_moe_experts"))
    if cfg.model.position_embedding_type == "learned_absolute":
        checks.append(("model", "max_position_embeddings"))  # the size of the position table
    for concern, name in checks:
        if name not in saved.get(concern, {}) or name not in current.get(concern, {}):
            continue  # a field the saving version did not have
        old, new = saved[concern][name], current[concern][name]
        if old != new:
            flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
            diffs.append(f"{name}={old!r}, this run has {new!r} ({flag})")
    if diffs:
        layout_changed = any(name in PARALLEL_CHECK_FIELDS for name in (d.split("=", 1)[0] for d in diffs))
        fix = (
            " --ckpt-format torch keeps one file per tensor- and pipeline-parallel rank and cannot change "
            "--tensor-model-parallel-size or --pipeline-model-parallel-size at load: load it at the saving "
            "layout, or save with --ckpt-format torch_dist, whose checkpoints load at any layout."
            if layout_changed
            else ""
        )
        raise ValueError(
            f"checkpoint {path} was saved with " + "; ".join(diffs) + ". Pass the model flags of the run that "
            "saved it, or point --load at a checkpoint of this model." + fix
        )


def check_expert_form(saved: dict[str, Any], cfg, path: str) -> None:
    """The torch format keeps the experts in the saving run's module form: refuses the other."""
    saved_grouped = saved.get("moe", {}).get("moe_grouped_gemm")
    if saved_grouped is None or not cfg.moe.num_moe_experts or bool(saved_grouped) == cfg.moe.moe_grouped_gemm:
        return
    said = "with" if saved_grouped else "without"
    raise ValueError(
        f"checkpoint {path} was saved {said} --moe-grouped-gemm, and --ckpt-format torch files hold the experts "
        "in that form only: load it with the saving run's --moe-grouped-gemm setting, or use --ckpt-format "
        "torch_dist, whose checkpoints load with --moe-grouped-gemm on or off."
    )
