"""Full activation recompute of transformer layers (``--recompute-granularity full``).

``run_layers`` runs a block's layers in order; with full recompute it wraps chunks of
layers in ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout
draws the same masks when backward recomputes), which keeps only each chunk's input
alive until backward:

- ``uniform``: consecutive chunks of ``--recompute-num-layers`` layers, every one
  recomputed (the last chunk may be shorter);
- ``block``: the first ``--recompute-num-layers`` layers, one at a time; the rest run
  normally.

Selective recompute (``--recompute-granularity selective --recompute-modules ...``)
uses the two helpers at the end of this file: ``checkpointed`` (a module keeps only its
inputs; ``core_attn``, ``mlp``, ``moe``, ``shared_experts``) and ``OutputDiscarder``
(an elementwise part's output is not kept by the ops that read it: it is recomputed from
its inputs when their backward needs it; ``layernorm``, ``moe_act``).

Losses and gradients equal the run without recompute: the same kernels run on the
same inputs, once more in backward. Recompute is off in evaluation and under
``torch.no_grad()``.

With ``--cuda-graph-impl local`` (``check_recompute_with_graphs``), as in Megatron: full
recompute is refused, and each selectively recomputed module must lie wholly inside one
graphed region or wholly outside the graphs. Inside a region the recompute is captured
into the region's backward graph; a module outside runs and recomputes eagerly between
the graphs. A module recomputed inside a graph must draw no random numbers: the
backward graph's replay would draw a different dropout mask than its forward did.
"""

import weakref
from collections.abc import Callable

import torch
import torch.utils.checkpoint

from megatron.core.config_utils import require

SELECTIVE_MODULES = ("core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts")
"""``--recompute-modules`` values this trainer implements (Megatron's, less MLA, GatedDeltaNet/Product and mHC)."""


def _run_chunk(layers, hidden_states, rotary_pos_emb, attention_mask=None):
    for layer in layers:
        hidden_states = layer(hidden_states, rotary_pos_emb=rotary_pos_emb, attention_mask=attention_mask)
    return hidden_states


def recomputed_chunks(config, num_layers: int) -> list[tuple[int, int, bool]]:
    """``(start, end, recompute)`` layer ranges of one block, in order (pure)."""
    method, n = getattr(config, "recompute_method", None), getattr(config, "recompute_num_layers", None)
    if getattr(config, "recompute_granularity", None) != "full" or not n:
        return [(0, num_layers, False)] if num_layers else []
    if method == "uniform":
        return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
    chunks = [(i, i + 1, True) for i in range(min(n, num_layers))]
    if n < num_layers:
        chunks.append((n, num_layers, False))
    return chunks


def run_layers(layers, hidden_states: torch.Tensor, rotary_pos_emb, config, attention_mask=None) -> torch.Tensor:
    """Runs ``layers`` (a ``ModuleList``) in order, recomputing as the config asks."""
    if not (torch.is_grad_enabled() and layers.training) or getattr(config, "recompute_granularity", None) != "full":
        return _run_chunk(layers, hidden_states, rotary_pos_emb, attention_mask)
    for start, end, recompute in recomputed_chunks(config, len(layers)):
        chunk = layers[start:end]
        if recompute:
            hidden_states = torch.utils.checkpoint.checkpoint(
                _run_chunk, chunk, hidden_states, rotary_pos_emb, attention_mask, use_reentrant=False
            )
        else:
            hidden_states = _run_chunk(chunk, hidden_states, rotary_pos_emb, attention_mask)
    return hidden_states


def check_recompute_with_graphs(config, scopes: list[str]) -> None:
    """Raises ``ValueError`` when ``config``'s recompute cannot run with ``--cuda-graph-impl local``
    graphing ``scopes`` (empty: whole layers). ``config`` is a ``TransformerConfig``."""
    granularity = getattr(config, "recompute_granularity", None)
    require(
        granularity != "full",
        "--recompute-granularity full with --cuda-graph-impl local is not supported (as in Megatron, where "
        "full recompute needs --cuda-graph-impl full_iteration): a recomputed layer would replay its graphs "
        "again in backward. Use --recompute-granularity selective --recompute-modules ..., or drop "
        "--cuda-graph-impl local.",
    )
    if granularity != "selective":
        return
    graphed = set(scopes) if scopes else {"attn", "mlp", "moe", "mamba"}
    if graphed & {"moe_router", "moe_preprocess"} and "moe" not in graphed:
        fix = (
            "Drop {0} from --recompute-modules, or graph the whole MoE block instead (--cuda-graph-scope attn "
            "moe, with drop-and-pad)."
        )
        require(
            not recomputes(config, "moe"),
            "--recompute-modules moe with --cuda-graph-scope moe_router: recomputing an MoE layer would replay "
            "its router graph again in backward. " + fix.format("moe"),
        )
        require(
            not (config.moe.enabled and recomputes(config, "layernorm")),
            "--recompute-modules layernorm with --cuda-graph-scope moe_router: an MoE layer's pre-MLP norm runs "
            "in the router graph and its output leaves that graph for the experts, so it cannot be discarded "
            "there. " + fix.format("layernorm"),
        )
    # Only core attention draws random numbers inside what is recomputed (the MLPs' dropout is applied
    # after them, outside the checkpoint).
    require(
        not (config.attention_dropout > 0 and "attn" in graphed and recomputes(config, "core_attn")),
        "--recompute-modules core_attn inside the graphed attn region needs --attention-dropout 0 (as in "
        "Megatron): its backward graph would recompute the attention with another dropout mask than the "
        "forward graph drew. Set --attention-dropout 0, drop core_attn from --recompute-modules, or leave attn "
        "out of --cuda-graph-scope.",
    )


def recomputes(config, module: str) -> bool:
    """Whether ``--recompute-granularity selective`` recomputes ``module`` (a --recompute-modules name)."""
    if getattr(config, "recompute_granularity", None) != "selective":
        return False
    modules = getattr(config, "recompute_modules", None)
    return module in (("core_attn",) if modules is None else modules)  # unset: Megatron's default


def capturing() -> bool:
    """Whether a CUDA graph is capturing on the current stream (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def checkpointed(fn: Callable, *args):
    """``fn(*args)``, keeping only ``args`` for backward (non-reentrant; RNG state replayed) when
    autograd records, else a plain call.

    Under CUDA-graph capture the RNG state cannot be read, and a module recomputed inside a
    graph draws no random numbers (``check_recompute_with_graphs``), so none is replayed."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=not capturing())


def _identity(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device


class _Recomputed:
    """What a saved tensor becomes when it is a discarded output: the index of that output."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class OutputDiscarder:
    """Megatron's output-discarding checkpoint, on saved-tensor hooks.

    ``run(fn, *args)`` computes ``fn(*args)`` inside a checkpoint (so ``fn`` keeps only its
    inputs). Ops run inside ``hooks()`` that save that output for their backward save a
    marker instead; their backward gets ``fn(*args)`` recomputed (without autograd, once per
    output and backward pass). The recomputation must give the same values: ``fn`` is
    deterministic and draws no random numbers (norms, activations).
    """

    def __init__(self):
        # Per output: a weak reference (the output must be freed once its readers ran) and how to
        # recompute it.
        self._outputs: list[tuple[weakref.ref, Callable, tuple]] = []

    def run(self, fn: Callable, *args) -> torch.Tensor:
        """``fn(*args)``, registered for discarding (a plain call when autograd does not record)."""
        if not torch.is_grad_enabled():
            return fn(*args)
        out = checkpointed(fn, *args)
        inputs = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        self._outputs.append((weakref.ref(out), fn, inputs))
        return out

    def _match(self, tensor: torch.Tensor) -> int | None:
        # Only a live output matches: a freed one's memory may already hold another tensor of the
        # same shape (a loop's next activation). While alive, its address and layout are its own.
        key = None
        for i, (ref, _, _) in enumerate(self._outputs):
            out = ref()
            if out is None:
                continue
            if tensor is out:
                return i
            key = _identity(tensor) if key is None else key
            if key == _identity(out):
                return i
        return None

    def hooks(self):
        """The saved-tensor hooks under which the outputs' readers run."""
        specs = self._outputs  # the list, shared: outputs registered later match too
        cache: dict[int, torch.Tensor] = {}

        def pack(tensor: torch.Tensor):
            index = self._match(tensor) if specs else None
            return tensor if index is None else _Recomputed(index)

        def unpack(saved):
            if not isinstance(saved, _Recomputed):
                return saved
            if saved.index not in cache:
                _, fn, args = specs[saved.index]
                with torch.no_grad():
                    cache[saved.index] = fn(*args)
            return cache[saved.index]

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
