"""``--pipeline-model-parallel-layout``: Megatron's layout string, parsed into (virtual) stages.

The string lists the pipeline's stages in model order, separated by ``|``; stage ``i`` is
model chunk ``i // PP`` of pipeline rank ``i % PP``, so the stage count divided by
``--pipeline-model-parallel-size`` is the virtual stages per rank. Symbols: ``E`` the
embedding, ``t`` a transformer layer, ``L`` the loss (output layer), ``m`` a multi-token
prediction layer (refused here: this trainer does not build MTP). Repetition as upstream
writes it: ``x*N`` repeats one symbol (or one ``|``), ``(...)*N`` repeats a group, which
may hold ``|`` (groups do not nest); commas are cosmetic. ``Et*3|(tt|)*2tL`` is the stages
``Ettt``, ``tt``, ``tt``, ``tL``.

A stage may hold no transformer layer (``E|tt|tt|L``): its chunk runs the embedding, the
loss, or passes its input on. The embedding opens the first stage and the loss closes
the last one, once each; ``layout.stage_layer_counts`` turns the stages into the layer
counts every other part of the pipeline reads.
"""

from __future__ import annotations

import re

from megatron.core.config_utils import require

FLAG = "--pipeline-model-parallel-layout"
EMBEDDING, LAYER, LOSS, MTP = "E", "t", "L", "m"
_SYMBOLS = (EMBEDDING, LAYER, LOSS, MTP)
_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")  # (body)*N, body without parentheses
_REPEAT = re.compile(r"(.)\*(\d+)")  # x*N: one character N times


def parse_layout(text: str) -> tuple[str, ...]:
    """The stages of a layout string, each as its symbols in order (``"Ett"``, ``""``, ...).

    Raises:
        ValueError: A character that is no symbol, ``|``, ``,`` or part of a repetition.
    """
    expanded = text.replace(",", "")
    expanded = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), expanded)
    expanded = _REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), expanded)
    bad = sorted(set(expanded) - set(_SYMBOLS) - {"|"})
    require(
        not bad,
        f"{FLAG} {text!r}: cannot read {' '.join(repr(c) for c in bad)}; the symbols are E (embedding), "
        "t (transformer layer), L (loss) and m (MTP layer), '|' separates stages, x*N repeats a symbol and "
        "(...)*N a group (groups do not nest, every group needs its *N), commas are cosmetic.",
    )
    return tuple(expanded.split("|"))


def check_stages(text: str, pp: int) -> tuple[str, ...]:
    """Parses ``text`` and checks it against ``--pipeline-model-parallel-size`` (reads only).

    Returns:
        The stages, in model order.

    Raises:
        ValueError: Naming the flag and the fix: MTP layers, a stage count that is no
            multiple of PP, or an embedding / loss that is missing, repeated or misplaced.
    """
    stages = parse_layout(text)
    flat = "".join(stages)
    require(
        MTP not in flat,
        f"{FLAG} {text!r}: 'm' (multi-token prediction layers) is not supported: this trainer does not build "
        "MTP; drop the m symbols.",
    )
    n = len(stages)
    require(
        n % pp == 0,
        f"{FLAG} {text!r} has {n} stages, which is not a multiple of --pipeline-model-parallel-size ({pp}); "
        "give PP x (virtual stages per rank) stages.",
    )
    require(
        pp > 1 or n == 1,
        f"{FLAG} {text!r} has {n} stages: virtual pipeline stages need --pipeline-model-parallel-size > 1; "
        "raise it or give one stage.",
    )
    require(
        flat.count(EMBEDDING) == 1 and stages[0].startswith(EMBEDDING),
        f"{FLAG} {text!r}: the embedding 'E' must appear once, as the first symbol of the first stage "
        "(pipeline rank 0 runs it); e.g. Et*2|ttL.",
    )
    require(
        flat.count(LOSS) == 1 and stages[-1].endswith(LOSS),
        f"{FLAG} {text!r}: the loss 'L' must appear once, as the last symbol of the last stage "
        "(the last pipeline rank's last chunk runs it); e.g. Et*2|ttL.",
    )
    return stages


def layer_counts(stages: tuple[str, ...], num_layers: int, text: str) -> list[int]:
    """Transformer layers per stage, in model order; raises ``ValueError`` unless they add up to
    ``--num-layers``."""
    counts = [stage.count(LAYER) for stage in stages]
    require(
        sum(counts) == num_layers,
        f"{FLAG} {text!r} holds {sum(counts)} transformer layers ('t') but --num-layers is {num_layers}; "
        "make them agree.",
    )
    return counts


def describe(stages: tuple[str, ...], pp: int) -> list[str]:
    """One line per pipeline rank: what each of its chunks holds, layers numbered from 1."""
    lines, first = [], 1
    holdings: list[list[str]] = [[] for _ in range(pp)]
    for i, stage in enumerate(stages):
        count = stage.count(LAYER)
        parts = ["embedding"] if EMBEDDING in stage else []
        if count:
            parts.append(f"layer {first}" if count == 1 else f"layers {first}-{first + count - 1}")
        if LOSS in stage:
            parts.append("loss")
        holdings[i % pp].append(" + ".join(parts) or "(no layers)")
        first += count
    for rank, chunks in enumerate(holdings):
        lines.append(f"pipeline rank {rank}: " + " | ".join(chunks))
    return lines
