"""Which layers each pipeline stage and virtual stage (model chunk) holds: plain arithmetic.

Stages are numbered in model order: model chunk ``c`` of pipeline rank ``r`` is virtual
stage ``c * PP + r`` (Megatron's interleaving), so rank 0 holds the embedding (chunk 0)
and the last rank the loss head (its last chunk). Megatron's rules:
- even split: every virtual stage holds ``num_layers / (PP * VPP)`` layers;
- ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` fix the
  layers of the first / last pipeline rank; the other ranks split the rest evenly;
- with virtual stages each rank's layers split evenly over its chunks;
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
  count the embedding / the loss as one more layer in the even split: the first / last
  virtual stage then builds one transformer layer fewer (possibly none);
- ``--pipeline-model-parallel-layout`` lists every virtual stage's layers itself
  (``layout_string.py``); its stage count / PP is the virtual stages per rank.
Layer numbers are global (``offset + i + 1``), so a layer knows its place in the model
whatever the layout.
"""

from __future__ import annotations

from megatron.core.config_utils import require
from megatron.core.pipeline_parallel import layout_string


def virtual_stages_from_layers(parallel, num_layers: int) -> int | None:
    """The virtual stages per rank that ``--num-layers-per-virtual-pipeline-stage`` gives (None: the
    flag is not set); raises ``ValueError`` where it does not fit the layout. Reads only."""
    per_stage = parallel.num_layers_per_virtual_pipeline_stage
    pp = parallel.pipeline_model_parallel_size
    if per_stage is None:
        return None
    num_layers += sum(_accounted(parallel))  # the embedding / loss count as layers of the split
    require(
        not _uneven(parallel),
        "--num-layers-per-virtual-pipeline-stage cannot be combined with --decoder-first-pipeline-num-layers / "
        "--decoder-last-pipeline-num-layers; give --num-virtual-stages-per-pipeline-rank instead.",
    )
    require(
        per_stage >= 1 and num_layers % (per_stage * pp) == 0,
        f"--num-layers ({num_layers}) must be divisible by --num-layers-per-virtual-pipeline-stage ({per_stage}) x "
        f"--pipeline-model-parallel-size ({pp}).",
    )
    vpp = num_layers // pp // per_stage
    given = parallel.virtual_pipeline_model_parallel_size
    require(
        given is None or given == vpp,
        f"--virtual-pipeline-model-parallel-size ({given}) disagrees with --num-layers-per-virtual-pipeline-stage "
        f"({per_stage}), which gives {vpp} virtual stages per rank; give one of them.",
    )
    return vpp


def resolve_virtual_stages(parallel, num_layers: int) -> int | None:
    """Fills ``parallel.virtual_pipeline_model_parallel_size`` from
    ``--num-layers-per-virtual-pipeline-stage`` where it is unset and the layers split, and returns
    the virtual stages per rank (None: no interleaving). Layouts that do not fit are left as given
    for ``virtual_stages_from_layers`` to name."""
    try:
        vpp = virtual_stages_from_layers(parallel, num_layers)
    except ValueError:
        return parallel.virtual_pipeline_model_parallel_size
    if vpp is not None and parallel.virtual_pipeline_model_parallel_size is None:
        parallel.virtual_pipeline_model_parallel_size = vpp
    return parallel.virtual_pipeline_model_parallel_size


def _uneven(parallel) -> bool:
    return (
        getattr(parallel, "decoder_first_pipeline_num_layers", None) is not None
        or getattr(parallel, "decoder_last_pipeline_num_layers", None) is not None
    )


def num_chunks(parallel) -> int:
    """Model chunks per pipeline rank (1 without interleaving)."""
    return parallel.virtual_pipeline_model_parallel_size or 1


def rank_layer_counts(parallel, num_layers: int) -> list[int]:
    """Layers per pipeline rank, rank 0 first (raises ``ValueError`` naming the flags)."""
    pp = parallel.pipeline_model_parallel_size
    if getattr(parallel, "pipeline_model_parallel_layout", None) is not None:
        counts = stage_layer_counts(parallel, num_layers)
        return [sum(counts[r::pp]) for r in range(pp)]
    first = getattr(parallel, "decoder_first_pipeline_num_layers", None)
    last = getattr(parallel, "decoder_last_pipeline_num_layers", None)
    vpp = num_chunks(parallel)
    if first is None and last is None:
        require(
            num_layers % (pp * vpp) == 0,
            f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})"
            + (
                f" x virtual pipeline stages per rank ({vpp}, --num-virtual-stages-per-pipeline-rank)"
                if vpp > 1
                else ""
            )
            + "; change the layer count or the pipeline layout.",
        )
        return [num_layers // pp] * pp
    rest, ranks_left = num_layers, pp
    for value in (first, last):
        if value is not None:
            rest -= value
            ranks_left -= 1
    flags = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
    if ranks_left == 0:
        require(
            rest == 0,
            f"{flags} ({first} + {last}) must add up to --num-layers ({num_layers}) with "
            f"--pipeline-model-parallel-size {pp}.",
        )
        middle = 0
    else:
        require(
            rest >= ranks_left and rest % ranks_left == 0,
            f"with {flags}, the {rest} remaining layers of --num-layers ({num_layers}) must split evenly over "
            f"the other {ranks_left} pipeline stage(s) (at least one layer each); change the layer counts.",
        )
        middle = rest // ranks_left
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    for rank, count in enumerate(counts):
        require(
            count % vpp == 0,
            f"pipeline stage {rank} holds {count} layers, which do not split over {vpp} virtual stages per rank "
            f"(--num-virtual-stages-per-pipeline-rank); change {flags} or the virtual stages.",
        )
    return counts


def _accounted(parallel) -> tuple[int, int]:
    """(1 if the embedding, 1 if the loss counts as a layer of the split)."""
    return (
        int(bool(getattr(parallel, "account_for_embedding_in_pipeline_split", False))),
        int(bool(getattr(parallel, "account_for_loss_in_pipeline_split", False))),
    )


def stage_layer_counts(parallel, num_layers: int) -> list[int]:
    """Layers per virtual stage, in model order (``c * PP + r``)."""
    pp, vpp = parallel.pipeline_model_parallel_size, num_chunks(parallel)
    text = getattr(parallel, "pipeline_model_parallel_layout", None)
    if text is not None:
        stages = layout_string.check_stages(text, pp)
        assert len(stages) == pp * vpp, "ParallelConfig.resolve sets the virtual stages from the layout"
        return layout_string.layer_counts(stages, num_layers, text)
    embedding, loss = _accounted(parallel)
    if embedding or loss:
        flags = " / ".join(
            f for f, on in (("--account-for-embedding-in-pipeline-split", embedding),
                            ("--account-for-loss-in-pipeline-split", loss)) if on
        )  # fmt: skip
        require(
            not _uneven(parallel),
            f"{flags} cannot be combined with --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers (as in Megatron); use one way of placing the layers.",
        )
        total = num_layers + embedding + loss
        require(
            total % (pp * vpp) == 0,
            f"with {flags}, --num-layers ({num_layers}) + {embedding + loss} must be divisible by "
            f"--pipeline-model-parallel-size ({pp})" + (f" x virtual stages per rank ({vpp})" if vpp > 1 else "")
            + "; change the layer count or the pipeline layout.",
        )  # fmt: skip
        counts = [total // (pp * vpp)] * (pp * vpp)
        counts[0] -= embedding
        counts[-1] -= loss
        require(
            min(counts) >= 0,
            f"with {flags}, a pipeline stage of one layer cannot also hold the embedding and the loss; "
            "raise --num-layers or lower --pipeline-model-parallel-size.",
        )
        return counts
    per_rank = rank_layer_counts(parallel, num_layers)
    return [per_rank[r] // vpp for _c in range(vpp) for r in range(pp)]


def chunk_layers(parallel, num_layers: int, pp_rank: int) -> list[tuple[int, int]]:
    """``(layer offset, layer count)`` of each model chunk of ``pp_rank``, chunk 0 first."""
    pp, vpp = parallel.pipeline_model_parallel_size, num_chunks(parallel)
    counts = stage_layer_counts(parallel, num_layers)
    out = []
    for c in range(vpp):
        stage = c * pp + pp_rank
        out.append((sum(counts[:stage]), counts[stage]))
    return out
