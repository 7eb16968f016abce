"""The hybrid layer pattern (``--hybrid-layer-pattern``): parsing and pipeline segments.

One character per layer, Megatron's symbols: ``M`` Mamba, ``G`` gated delta net (GDN2
with ``--experimental-attention-variant gdn2``), ``*`` attention, ``-`` MLP, ``E`` MoE;
``|`` separates pipeline segments. The pattern gives the layer count. With
``|`` the segments are the model chunks: segment ``vp_stage * PP + pp_rank`` runs on
that rank, so 4 segments on PP=2 mean two virtual stages per rank. A pattern without
``|`` on PP > 1 is split evenly (Megatron's deprecated fallback).

Megatron's other symbols (``D`` DSA, ``+`` MLA, ``/`` MTP patterns) parse to a clear "not supported" error. Every error names the flag and the
offending symbol.
"""

import dataclasses

PATTERN_FLAG = "--hybrid-layer-pattern"


class Symbols:
    """Layer symbols of a hybrid pattern (Megatron's)."""

    MAMBA = "M"
    GDN = "G"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"
    PIPE = "|"
    VALID_LAYERS = (MAMBA, GDN, ATTENTION, MLP, MOE)
    # Megatron symbols this trainer has no layer for (symbol -> what it is).
    UNSUPPORTED = {"D": "DSA attention", "+": "MLA attention", "/": "MTP pattern separator"}
    NAMES = {MAMBA: "Mamba", GDN: "gated delta net", ATTENTION: "attention", MLP: "MLP", MOE: "MoE"}


_VALID_TEXT = "M (Mamba), G (gated delta net), * (attention), - (MLP), E (MoE), | (pipeline segment separator)"


@dataclasses.dataclass(frozen=True)
class HybridPattern:
    """A parsed pattern.

    Attributes:
        pattern: The pattern as given.
        segments: The layer symbols of each pipeline segment (one segment without ``|``).
    """

    pattern: str
    segments: tuple[str, ...]

    @property
    def layers(self) -> str:
        """All layer symbols, segments joined."""
        return "".join(self.segments)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def count(self, symbol: str) -> int:
        return self.layers.count(symbol)


def parse_hybrid_pattern(pattern: str, flag: str = PATTERN_FLAG) -> HybridPattern:
    """Parses and validates a pattern.

    Args:
        pattern: E.g. ``"M*M-M*M-"`` or ``"M*|M-"``.
        flag: The flag the pattern came from, for the error messages.

    Raises:
        ValueError: Naming ``flag`` and the bad symbol (and its position).
    """
    if not isinstance(pattern, str) or not pattern.replace(Symbols.PIPE, "").strip():
        raise ValueError(f"{flag} {pattern!r} has no layers; give one symbol per layer, e.g. 'M*M-'.")
    for position, symbol in enumerate(pattern):
        if symbol in Symbols.VALID_LAYERS or symbol == Symbols.PIPE:
            continue
        if symbol in Symbols.UNSUPPORTED:
            raise ValueError(
                f"{flag} {pattern!r}: symbol {symbol!r} at position {position} ({Symbols.UNSUPPORTED[symbol]}) "
                f"is not supported here; use {_VALID_TEXT}."
            )
        raise ValueError(
            f"{flag} {pattern!r}: {symbol!r} at position {position} is not a layer symbol; valid symbols are "
            f"{_VALID_TEXT}."
        )
    return HybridPattern(pattern, tuple(pattern.split(Symbols.PIPE)))


def virtual_pipeline_size(parsed: HybridPattern, pp_size: int, flag: str = PATTERN_FLAG) -> int | None:
    """Virtual stages per pipeline rank the pattern's segments imply (None: no virtual pipeline).

    Raises:
        ValueError: When the segment count is not a multiple of the pipeline size.
    """
    segments = parsed.num_segments
    if segments == 1:
        return None
    if segments % pp_size != 0:
        raise ValueError(
            f"{flag} {parsed.pattern!r} has {segments} pipeline segments, which is not a multiple of "
            f"--pipeline-model-parallel-size ({pp_size}); give PP or a multiple of PP segments separated by '|'."
        )
    return segments // pp_size if segments > pp_size else None


def select_pipeline_segment(
    parsed: HybridPattern,
    pp_rank: int = 0,
    pp_size: int = 1,
    vp_stage: int | None = None,
    rank_layers: list[int] | None = None,
) -> tuple[str, int]:
    """The layers of one model chunk and the global index of its first layer.

    Args:
        parsed: The parsed pattern.
        pp_rank: This rank's pipeline stage.
        pp_size: Pipeline size.
        vp_stage: Virtual stage of the chunk (None without a virtual pipeline).
        rank_layers: For a pattern without '|', the layers of each pipeline rank
            (``layout.rank_layer_counts``: --decoder-first/last-pipeline-num-layers);
            None splits them evenly.

    Returns:
        ``(layer symbols, layer offset)``.
    """
    segments = parsed.segments
    if len(segments) == 1:
        if vp_stage not in (None, 0):
            raise ValueError(
                f"{PATTERN_FLAG} {parsed.pattern!r} has no '|' separators, so it has no virtual pipeline stages; "
                "separate the chunks with '|'."
            )
        layers = segments[0]
        if rank_layers is None:
            if len(layers) % pp_size != 0:
                raise ValueError(
                    f"{PATTERN_FLAG} {parsed.pattern!r} has {len(layers)} layers and no '|' separators, which do "
                    f"not split evenly over --pipeline-model-parallel-size {pp_size}; mark the stages with '|'."
                )
            rank_layers = [len(layers) // pp_size] * pp_size
        assert len(rank_layers) == pp_size and sum(rank_layers) == len(layers), (rank_layers, parsed.pattern)
        offset = sum(rank_layers[:pp_rank])
        return layers[offset : offset + rank_layers[pp_rank]], offset
    virtual_pipeline_size(parsed, pp_size)  # raises for a segment count that does not fit
    index = (vp_stage or 0) * pp_size + pp_rank
    if index >= len(segments):
        raise ValueError(
            f"{PATTERN_FLAG} {parsed.pattern!r} has {len(segments)} segments; pipeline rank {pp_rank}, virtual "
            f"stage {vp_stage} would need segment {index}."
        )
    return segments[index], sum(len(s) for s in segments[:index])
