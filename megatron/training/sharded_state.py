"""Layout-free keys and chunks of the model and optimizer state, for ``--ckpt-format torch_dist``.

A parallel run holds every tensor of the model in pieces: TP ranks hold slices of a
split weight (along ``partition_dim``, in ``partition_stride`` blocks or the blocks of
``partition_sizes``), pipeline stages hold disjoint layers, EP ranks disjoint experts,
and the distributed optimizer gives each DP rank a flat element range of every
parameter's state. This file names each tensor by what it is in the one-process model
and describes this rank's part as rectangles of the full tensor::

    model.<name>                        the full weight (or persistent buffer)
    optimizer.state.<moment>.<name>     exp_avg, exp_avg_sq (SGD: momentum_buffer), full shape
    optimizer.state.fp32_param.<name>   the fp32 main copy of a bf16/fp16 weight
    optimizer.state.step.<name>         0-d

``<name>`` is the parameter's name in the one-process model: layers by their GLOBAL
layer number (``decoder.layers.<layer_number - 1>``, whatever the pipeline stage or
virtual chunk), routed experts by their global index, and the copy of a tied
embedding held by the last pipeline stage (``shared_embedding``) under the first
stage's ``embedding.word_embeddings.weight``. So a checkpoint saved at one TP x PP x
DP (x EP) layout loads at any other with the same model. Routed experts are saved in the
saving run's form (``--moe-grouped-gemm``: one ``[E, ...]`` tensor per linear; the loop:
one tensor per expert) and read in either (``entries_in_stored_form``).

What is unusual:
- A flat element range of a TP shard (a distributed-optimizer piece) is in general not
  a rectangle of the full tensor. It is cut into at most ``2 * ndim - 1`` rectangles
  (``flat_range_boxes``: a partial first row, whole rows, a partial last row,
  recursively), and each of those at the TP blocks. Every rectangle gets a view of the
  local memory (``as_strided``), so DCP writes from and loads into the live tensors.
- Each element of a full tensor is written by exactly one rank (replicas: by the rank
  that is first in each group over which the tensor is replicated), so DCP's metadata
  covers every tensor once, without overlaps; every rank reads what it holds.
- The DCP planners (``SavePlanner`` / ``LoadPlanner`` subclasses, DCP's documented
  extension point) take their chunks from here instead of from a state dict of
  DTensors: DTensor placements cannot express strided TP blocks or flat DP ranges.
"""

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer.state."
FP32_PARAM = "fp32_param"
STEP = "step"
TIED_EMBEDDING = "embedding.word_embeddings.weight"


@dataclasses.dataclass
class Chunk:
    """A rectangle of a full tensor and the local memory that holds it.

    Attributes:
        offsets: Start of the rectangle in the full tensor, per dimension.
        sizes: Its extent per dimension (``view.shape``).
        view: A view of the local tensor with exactly these elements.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    view: torch.Tensor


@dataclasses.dataclass
class Entry:
    """One key of the checkpoint as this rank sees it.

    Attributes:
        key: The layout-free key (``model.<name>``, ``optimizer.state.<what>.<name>``).
        full_shape: The tensor's shape in the one-process model.
        chunks: This rank's rectangles of it (disjoint).
        write: Whether this rank writes its chunks (one writer per element).
    """

    key: str
    full_shape: tuple[int, ...]
    chunks: list[Chunk]
    write: bool


# ---------------------------------------------------------------------- geometry


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> Iterator[tuple[tuple, tuple]]:
    """The rectangles ``(offsets, sizes)`` that together hold flat elements ``[start, end)``
    of a row-major tensor of ``shape``, in order; at most ``2 * ndim - 1`` of them."""
    if start >= end:
        return
    if len(shape) == 0:
        yield (), ()
        return
    inner = math.prod(shape[1:])
    first, first_rest = divmod(start, inner)
    last, last_rest = divmod(end, inner)
    if first == last:  # inside one row of dim 0
        for off, size in flat_range_boxes(shape[1:], first_rest, last_rest):
            yield (first, *off), (1, *size)
        return
    if first_rest:
        for off, size in flat_range_boxes(shape[1:], first_rest, inner):
            yield (first, *off), (1, *size)
        first += 1
    if last > first:
        yield (first, *([0] * (len(shape) - 1))), (last - first, *shape[1:])
    if last_rest:
        for off, size in flat_range_boxes(shape[1:], 0, last_rest):
            yield (last, *off), (1, *size)


Segments = list[tuple[int, int, int]]  # (local start, full start, length) along one dimension


def _split_dim(local: int, blocks: Sequence[int], group_size: int, group_rank: int) -> tuple[Segments, int]:
    """Segments of one split dimension: local block ``k`` (``blocks[k]`` long) is part
    ``group_rank`` of full block ``k`` (``blocks[k] * group_size`` long). Returns the
    segments and the full extent."""
    assert sum(blocks) == local, (blocks, local)
    segments, local_start, full_start = [], 0, 0
    for b in blocks:
        segments.append((local_start, full_start + group_rank * b, b))
        local_start += b
        full_start += b * group_size
    return segments, full_start


def _map_box(offsets: tuple, sizes: tuple, dims: list[Segments]) -> Iterator[tuple[tuple, tuple, tuple]]:
    """Cuts a local rectangle at the segment boundaries: ``(local offsets, full offsets, sizes)``."""
    per_dim = []
    for off, size, segments in zip(offsets, sizes, dims):
        parts = []
        for local_start, full_start, length in segments:
            lo, hi = max(off, local_start), min(off + size, local_start + length)
            if lo < hi:
                parts.append((lo, full_start + lo - local_start, hi - lo))
        per_dim.append(parts)

    def product(d):
        if d == len(per_dim):
            yield (), (), ()
            return
        for lo, full, n in per_dim[d]:
            for rest_lo, rest_full, rest_n in product(d + 1):
                yield (lo, *rest_lo), (full, *rest_full), (n, *rest_n)

    yield from product(0)


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


# ---------------------------------------------------------------------- names and layouts


@dataclasses.dataclass
class TensorLayout:
    """Where a local tensor sits in the full one and who writes it.

    Attributes:
        name: The global (one-process) name.
        local_shape: Its shape on this rank.
        dims: Per dimension, the segments mapping local to full coordinates.
        full_shape: Its shape in the one-process model.
        replica_owner: False on ranks that hold a replica some other rank writes
            (TP ranks other than the first of a replicated tensor, later pipeline
            stages' copy of a tied embedding). Data-parallel replication is decided
            by the caller (the distributed optimizer's pieces are not replicas).
        is_expert: An expert parameter (its data-parallel group is expert-DP).
    """

    name: str
    local_shape: tuple[int, ...]
    dims: list[Segments]
    full_shape: tuple[int, ...]
    replica_owner: bool
    is_expert: bool


_LAYER_INDEX = re.compile(r"^\d+$")


def _module_renames(module: torch.nn.Module) -> tuple[dict[str, str], dict[str, tuple[int, int]]]:
    """Module-path renames to global names, and grouped-expert offsets.

    Returns:
        ``{local module path: global module path}`` for layers (by ``layer_number``)
        and sequential experts (by the dispatcher's ``local_expert_indices``), and
        ``{module path: (first global expert, experts in all)}`` for grouped experts,
        whose parameters hold the local experts along dim 0.
    """
    renames: dict[str, str] = {}
    grouped: dict[str, tuple[int, int]] = {}
    for path, sub in module.named_modules():
        parent, _, last = path.rpartition(".")
        layer_number = getattr(sub, "layer_number", None)
        if _LAYER_INDEX.match(last) and isinstance(layer_number, int):
            renames[path] = f"{parent}.{layer_number - 1}" if parent else str(layer_number - 1)
        dispatcher, experts = getattr(sub, "token_dispatcher", None), getattr(sub, "experts", None)
        indices = getattr(dispatcher, "local_expert_indices", None)
        if indices is None or experts is None:
            continue
        indices = list(indices)
        prefix = f"{path}.experts" if path else "experts"
        local = getattr(experts, "local_experts", None)
        if local is not None:
            for i in range(len(local)):
                renames[f"{prefix}.local_experts.{i}"] = f"{prefix}.local_experts.{indices[i]}"
        elif dispatcher.ep_size > 1:
            grouped[prefix] = (indices[0], dispatcher.num_experts)
    return renames, grouped


def _global_name(name: str, renames: dict[str, str]) -> str:
    """Applies the renames of ``_module_renames`` to every prefix of a dotted name."""
    parts = name.split(".")
    out = []
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        renamed = renames.get(path)
        out.append(renamed.rpartition(".")[2] if renamed is not None else part)
    return ".".join(out)


def _tp_of(tensor, pg) -> tuple[int, int]:
    if getattr(tensor, "is_expert", False):
        return getattr(pg, "expt_tp_size", 1), getattr(pg, "expt_tp_rank", 0)
    return pg.tp_size, pg.tp_rank


def tensor_layouts(modules, pg) -> list[tuple[torch.Tensor, TensorLayout]]:
    """Every tensor of the model's state dict (parameters and persistent buffers) with its layout.

    Args:
        modules: The model (unwrapped), or its chunks (virtual pipeline stages).
        pg: This rank's ``ProcessGroups``.
    """
    chunks = list(modules) if isinstance(modules, (Sequence, torch.nn.ModuleList)) else [modules]
    out, seen = [], set()
    for chunk in chunks:
        renames, grouped = _module_renames(chunk)
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            gname = _global_name(name, renames)
            tied_copy = bool(getattr(tensor, "shared_embedding", False))
            if tied_copy:
                gname = TIED_EMBEDDING  # the last stage's copy is the first stage's weight
            layout = _layout(gname, tensor, pg, grouped, name)
            layout.replica_owner = layout.replica_owner and not tied_copy
            out.append((tensor, layout))
    return out


def model_layouts(modules, pg) -> dict[str, tuple[torch.Tensor, TensorLayout]]:
    """``tensor_layouts`` by global name: ``{name: (local tensor, layout)}``."""
    out: dict[str, tuple[torch.Tensor, TensorLayout]] = {}
    for tensor, layout in tensor_layouts(modules, pg):
        assert layout.name not in out, f"this rank holds two tensors named {layout.name}"
        out[layout.name] = (tensor, layout)
    return out


def _layout(gname: str, tensor: torch.Tensor, pg, grouped: dict[str, tuple[int, int]], local_name: str) -> TensorLayout:
    shape = tuple(tensor.shape)
    dims: list[Segments] = [[(0, 0, n)] for n in shape]
    full = list(shape)
    tp_size, tp_rank = _tp_of(tensor, pg)
    tp_split = bool(getattr(tensor, "tensor_model_parallel", False)) and tp_size > 1
    if tp_split:
        d = tensor.partition_dim
        blocks = getattr(tensor, "partition_sizes", None)
        if blocks is None:
            stride = getattr(tensor, "partition_stride", 1)
            blocks = [shape[d] // stride] * stride
        dims[d], full[d] = _split_dim(shape[d], list(blocks), tp_size, tp_rank)
    for prefix, (first, total) in grouped.items():
        if local_name.startswith(prefix + ".") and shape:
            dims[0], full[0] = [(0, first, shape[0])], total  # the local experts along dim 0
    return TensorLayout(
        name=gname,
        local_shape=shape,
        dims=dims,
        full_shape=tuple(full),
        replica_owner=tp_split or tp_rank == 0,
        is_expert=bool(getattr(tensor, "is_expert", False)),
    )


def dp_first(layout: TensorLayout, pg) -> bool:
    """Whether this rank is the first of the data-parallel group holding ``layout``'s tensor."""
    if layout.is_expert:
        return getattr(pg, "expt_dp_rank", pg.dp_rank) == 0
    return pg.dp_rank == 0


def chunks_of(layout: TensorLayout, flat: torch.Tensor, start: int = 0) -> list[Chunk]:
    """The rectangles of the full tensor held by ``flat``: a contiguous 1-D tensor with
    local flat elements ``[start, start + flat.numel())`` of ``layout``'s local tensor."""
    assert flat.dim() <= 1 and flat.is_contiguous(), "chunks_of needs a contiguous flat tensor"
    if not layout.local_shape:  # 0-d
        return [Chunk((), (), flat.reshape(()))]
    strides = _row_major_strides(layout.local_shape)
    base = flat.storage_offset()
    out = []
    for offsets, sizes in flat_range_boxes(layout.local_shape, start, start + flat.numel()):
        for local_off, full_off, sub_sizes in _map_box(offsets, sizes, layout.dims):
            at = sum(o * s for o, s in zip(local_off, strides)) - start
            out.append(Chunk(full_off, sub_sizes, flat.as_strided(sub_sizes, strides, base + at)))
    return out


# ---------------------------------------------------------------------- entries


def model_entries(modules, pg) -> list[Entry]:
    """``model.<name>`` entries: each rank holds (and reads) its whole local tensors."""
    entries = []
    for gname, (tensor, layout) in model_layouts(modules, pg).items():
        flat = tensor.detach().reshape(-1) if tensor.dim() else tensor.detach()
        entries.append(
            Entry(
                MODEL_PREFIX + gname,
                layout.full_shape,
                chunks_of(layout, flat),
                write=layout.replica_owner and dp_first(layout, pg),
            )
        )
    return entries


def optimizer_entries(optimizer, modules, pg) -> list[Entry]:
    """``optimizer.state.<what>.<name>`` entries of this rank's optimizer pieces.

    Args:
        optimizer: A ``MixedPrecisionOptimizer`` (or the distributed one): its
            ``state_pieces()``, ``state_names()``, ``sharded_over_dp`` (and then
            ``writes_pieces``). A loader allocates the state first (``allocate_state``).
        modules: The model (unwrapped) or its chunks, for the names.
        pg: This rank's ``ProcessGroups``.
    """
    names = set(optimizer.state_names()) | {FP32_PARAM}
    layouts = {id(t): layout for t, layout in tensor_layouts(modules, pg)}
    entries: dict[str, Entry] = {}
    for piece in optimizer.state_pieces():
        layout = layouts[id(piece.param)]
        if optimizer.sharded_over_dp:  # several optimizer instances: instance 0 writes, the others hold copies
            owner = layout.replica_owner and getattr(optimizer, "writes_pieces", True)
        else:
            owner = layout.replica_owner and dp_first(layout, pg)
        tensors = dict(piece.state)
        if piece.fp32_copy:
            tensors[FP32_PARAM] = piece.main
        for what, value in tensors.items():
            if what not in names or not torch.is_tensor(value):
                continue
            key = f"{OPTIMIZER_PREFIX}{what}.{layout.name}"
            if what == STEP or value.dim() == 0:
                if piece.start == 0:  # one writer per parameter: the holder of its first element
                    entries[key] = Entry(key, (), [Chunk((), (), value)], write=owner)
                elif key not in entries:
                    entries[key] = Entry(key, (), [Chunk((), (), value)], write=False)
                continue
            flat = value.reshape(-1)
            assert flat.numel() == piece.end - piece.start, (key, flat.numel(), piece.start, piece.end)
            entry = entries.setdefault(key, Entry(key, layout.full_shape, [], write=owner))
            entry.chunks += chunks_of(layout, flat, piece.start)
    return list(entries.values())


# ---------------------------------------------------------------------- DCP planners


def _chunk_md(chunk: Chunk) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes the chunks of the entries this rank owns (DCP's state dict is unused)."""

    def __init__(self, entries: list[Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._entries = entries
        self._views: dict[tuple, torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for entry in self._entries:
            if not entry.write:
                continue
            for chunk in entry.chunks:
                index = MetadataIndex(entry.key, chunk.offsets)
                items.append(
                    WriteItem(
                        index=index,
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=_chunk_md(chunk),
                            properties=TensorProperties.create_from_tensor(chunk.view),
                            size=torch.Size(entry.full_shape),
                        ),
                    )
                )
                self._views[(entry.key, tuple(chunk.offsets))] = chunk.view
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._views[(write_item.index.fqn, tuple(write_item.index.offset))]


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads every chunk of the given entries into its local view (in place)."""

    def __init__(self, entries: list[Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self._entries = entries
        self._views: dict[tuple, torch.Tensor] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        stored = self.metadata.state_dict_metadata
        for entry in self._entries:
            md = stored[entry.key]
            requests += create_read_items_for_chunk_list(entry.key, md, [_chunk_md(c) for c in entry.chunks])
            for chunk in entry.chunks:
                self._views[(entry.key, tuple(chunk.offsets))] = chunk.view
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._views[(index.fqn, tuple(index.offset))]


# ---------------------------------------------------------------------- expert forms

# The two forms of a routed expert's linear: ``--moe-grouped-gemm`` holds every expert in one
# ``[E, ...]`` tensor (``...experts.linear_fc1.weight``), the loop one tensor per expert
# (``...experts.local_experts.<global expert>.linear_fc1.weight``). Row g of the first is the second.
_GROUPED_KEY = re.compile(r"^(.*\.experts\.)(linear_fc[12]\.(?:weight|bias))$")
_LOOP_KEY = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")


def entries_in_stored_form(entries: list[Entry], metadata) -> tuple[list[Entry], list[tuple]]:
    """Rewrites expert entries into the form the checkpoint holds, for loading across
    ``--moe-grouped-gemm`` on and off; every other entry is returned as it is.

    Args:
        entries: This rank's entries (model and optimizer).
        metadata: The checkpoint's DCP ``Metadata``.

    Returns:
        The entries to read, and ``(destination, source)`` pairs of 0-d tensors to copy after
        the read: several loop experts' ``step`` read one grouped ``step`` (they are equal).
    """
    stored = metadata.state_dict_metadata
    out: dict[str, Entry] = {}
    copies: list[tuple] = []

    def add(key, full_shape, chunk):
        entry = out.setdefault(key, Entry(key, tuple(full_shape), [], write=False))
        if any(c.offsets == chunk.offsets for c in entry.chunks):  # a 0-d step read once
            first = next(c for c in entry.chunks if c.offsets == chunk.offsets)
            copies.append((chunk.view, first.view))
        else:
            entry.chunks.append(chunk)

    for entry in entries:
        grouped, loop = _GROUPED_KEY.match(entry.key), _LOOP_KEY.match(entry.key)
        if entry.key in stored or (grouped is None and loop is None):
            out[entry.key] = entry
            continue
        if grouped is not None:  # grouped here, one tensor per expert in the checkpoint
            head, tail = grouped.groups()
            if not entry.full_shape:  # the parameter's step: any expert's
                key = f"{head}local_experts.0.{tail}"
                add(key if key in stored else entry.key, (), entry.chunks[0])
                continue
            for chunk in entry.chunks:
                for j in range(chunk.sizes[0]):
                    key = f"{head}local_experts.{chunk.offsets[0] + j}.{tail}"
                    add(key, entry.full_shape[1:], Chunk(chunk.offsets[1:], chunk.sizes[1:], chunk.view[j]))
            continue
        head, expert, tail = loop.groups()  # one tensor per expert here, grouped in the checkpoint
        key = head + tail
        if key not in stored:
            out[entry.key] = entry
            continue
        full = (stored[key].size[0], *entry.full_shape) if entry.full_shape else ()
        for chunk in entry.chunks:
            if entry.full_shape:
                chunk = Chunk((int(expert), *chunk.offsets), (1, *chunk.sizes), chunk.view.unsqueeze(0))
            add(key, full, chunk)
    return list(out.values()), copies
