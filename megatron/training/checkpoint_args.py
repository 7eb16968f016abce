"""``--use-checkpoint-args``: the model flags of the checkpoint to load instead of the command line's.

Megatron's ``load_args_from_checkpoint`` sets two kinds of argument from the checkpoint:

- the model's sizes (layers, hidden, FFN, heads, sequence length, the padded vocabulary, ...), only
  where the command line leaves them out;
- the model's form (attention groups, position embedding, bias, activation, normalisation, dropout,
  experts, Mamba sizes, the tokenizer), always.

``--use-mp-args-from-checkpoint-args`` also takes the parallel sizes, and
``--no-use-tokenizer-model-from-checkpoint-args`` keeps the command line's tokenizer. The checkpoint
is the one ``--load`` holds (``--ckpt-step``'s iteration, if given), else ``--pretrained-checkpoint``'s;
its saved run config (both formats store one) is read without loading any tensor. The values are the
saving run's resolved ones (a derived FFN width comes back as given), in this trainer's field names.
"""

import glob
import os

import torch

from megatron.training import checkpointing as ckpt

# Megatron's _set_arg(name): set from the checkpoint when the command line leaves it out.
UNLESS_GIVEN = (
    "model.num_layers",
    "model.hidden_size",
    "model.ffn_hidden_size",
    "model.seq_length",
    "model.num_attention_heads",
    "model.kv_channels",
    "model.max_position_embeddings",
    "mamba.hybrid_layer_pattern",
    "moe.moe_token_dispatcher_type",
    "checkpoint.ckpt_format",
)
# Megatron's _set_arg(name, force=True): always set from the checkpoint.
ALWAYS = (
    "model.num_query_groups",
    "model.group_query_attention",
    "model.position_embedding_type",
    "model.add_position_embedding",
    "model.rotary_base",
    "model.rotary_percent",
    "model.rotary_interleaved",
    "model.add_bias_linear",
    "model.add_qkv_bias",
    "model.squared_relu",
    "model.gated_linear_unit",
    "model.untie_embeddings_and_output_weights",
    "model.apply_layernorm_1p",
    "model.normalization",
    "model.apply_query_key_layer_scaling",
    "model.attention_dropout",
    "model.hidden_dropout",
    "moe.num_moe_experts",
    "moe.moe_layer_freq",
    "moe.moe_ffn_hidden_size",
    "moe.moe_router_topk",
    "moe.moe_router_pre_softmax",
    "moe.moe_grouped_gemm",
    "moe.moe_shared_expert_intermediate_size",
    "moe.moe_router_score_function",
    "moe.moe_router_enable_expert_bias",
    "moe.moe_router_topk_scaling_factor",
    "mamba.mamba_state_dim",
    "mamba.mamba_head_dim",
    "mamba.mamba_num_groups",
    "mamba.mamba_num_heads",
)
TOKENIZER = ("data.tokenizer_type", "data.tokenizer_model")
PARALLEL = (
    "parallel.tensor_model_parallel_size",
    "parallel.pipeline_model_parallel_size",
    "parallel.virtual_pipeline_model_parallel_size",
    "parallel.expert_model_parallel_size",
)


def saved_run_config(load_dir: str, ckpt_step: int | None) -> tuple[dict, str]:
    """The run config a checkpoint folder's checkpoint was saved with, and the file it came from.

    Raises:
        ValueError: No checkpoint in ``load_dir``, or its file holds no run config.
    """
    from megatron.training import dist_checkpointing  # it imports this package's trainer-side modules

    if not ckpt.has_checkpoint(load_dir):
        raise ValueError(f"--use-checkpoint-args: {load_dir} holds no checkpoint to read the model flags from.")
    iteration, release = ckpt.iteration_to_load(load_dir, ckpt_step)
    folder = os.path.join(load_dir, ckpt.iteration_dir_name(iteration, release))
    common = os.path.join(folder, dist_checkpointing.COMMON_FILENAME)
    if os.path.isfile(common):
        path, saved = common, dist_checkpointing.read_common(common)
    else:
        files = sorted(glob.glob(os.path.join(folder, "mp_rank_*", ckpt.CHECKPOINT_FILENAME)))
        if not files:
            raise ValueError(f"--use-checkpoint-args: {folder} holds no checkpoint file.")
        path = files[0]
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # no tensor is read
    if not isinstance(saved.get("config"), dict):
        raise ValueError(f"--use-checkpoint-args: {path} holds no run config; give the model flags instead.")
    return saved["config"], path


def apply(cfg) -> list[str]:
    """Sets ``cfg``'s (an unresolved ``RunConfig``) model flags from its checkpoint; returns a line per
    value that changed, as Megatron prints them."""
    c = cfg.checkpoint
    source = c.load if c.load and ckpt.has_checkpoint(c.load) else c.pretrained_checkpoint or c.load
    if not ckpt.has_checkpoint(source):  # a first launch that will save into --load: Megatron goes on too
        return ["Checkpoint not found to provide arguments, using provided arguments."]
    saved, _ = saved_run_config(source, c.ckpt_step)
    given = set(cfg.given_fields)
    names = [n for n in UNLESS_GIVEN if n not in given] + list(ALWAYS)
    if c.use_tokenizer_model_from_checkpoint_args:
        names += TOKENIZER
    if c.use_mp_args_from_checkpoint_args:
        names += PARALLEL
    if saved.get("mamba", {}).get("hybrid_layer_pattern") is not None:
        names = [n for n in names if n != "model.num_layers"]  # the pattern gives the layer count
    lines = []
    saved_vocab = saved.get("model", {}).get("vocab_size")
    if "data.padded_vocab_size" not in given and saved_vocab is not None:  # Megatron's padded_vocab_size
        saved.setdefault("data", {})["padded_vocab_size"] = saved_vocab
        names.append("data.padded_vocab_size")
    for name in names:
        group, field = name.split(".")
        if field not in saved.get(group, {}):
            continue  # a field the saving version did not have
        value, section = saved[group][field], getattr(cfg, group)
        if value is not None and value != getattr(section, field):
            setattr(section, field, value)
            lines.append(f"Setting {field} to {value} from checkpoint")
    return lines
