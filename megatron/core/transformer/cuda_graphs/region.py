"""One graphable region: its call signature, warm-up, and per-slot capture and replay.

A region is a method of a layer (``forward`` for a whole layer, or e.g.
``_forward_attention``) whose tensor arguments and outputs become static buffers. It
holds one forward/backward graph pair per micro-batch slot in flight. The session
decides order and buffers (``plan.py``, ``capture.py``); this file does the torch work
for one region and never calls back into the session.

Parameters are not graph inputs: their addresses are stable, and the backward graph
adds their gradients into ``param.main_grad`` itself. A *shared* parameter (one that
eager code also differentiates, e.g. a tied embedding used by the loss head) is the
exception: its gradient lands in a static buffer that becomes ``param.grad``, so
autograd adds the eager contribution to it in the parameter's dtype before DDP folds it
into ``main_grad``, exactly as in an eager run. With gradient-accumulation fusion the
region's part goes into ``main_grad`` inside the graph (as eager does) and DDP only
waits on the graph's event for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from megatron.core.transformer.cuda_graphs.plan import Source


class TensorMeta(NamedTuple):
    """What a static buffer must match. Strides are not part of it: static buffers are
    contiguous and a copy into them accepts any layout."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


class ValueArg(NamedTuple):
    """A non-tensor argument, baked into the graph."""

    value: Any


ArgMeta = TensorMeta | ValueArg


def arg_metadata(args: Sequence[Any]) -> list[ArgMeta]:
    return [
        TensorMeta(a.shape, a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else ValueArg(a)
        for a in args
    ]


def _describe(meta: ArgMeta) -> str:
    if isinstance(meta, ValueArg):
        return repr(meta.value)
    return f"tensor(shape={tuple(meta.shape)}, dtype={meta.dtype}, device={meta.device}, requires_grad={meta.requires_grad})"


@dataclasses.dataclass
class SlotGraphs:
    """The graphs of one region in one micro-batch slot, and the buffers they replay on."""

    fwd_graph: torch.cuda.CUDAGraph | None = None
    bwd_graph: torch.cuda.CUDAGraph | None = None
    capture_args: list[Any] | None = None  # roots and leaves of the backward capture
    fwd_outputs: tuple[torch.Tensor, ...] | None = None
    replay_inputs: list[tuple[int, torch.Tensor, bool]] = dataclasses.field(
        default_factory=list
    )  # (arg, static, copy?)
    replay_outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    replay_grad_outputs: list[tuple[torch.Tensor, bool] | None] = dataclasses.field(default_factory=list)
    replay_grad_inputs: list[tuple[torch.Tensor, bool]] = dataclasses.field(default_factory=list)  # (dgrad, copy out?)
    shared_grads: list[torch.Tensor] = dataclasses.field(default_factory=list)  # static wgrads of shared params
    wgrad_event: torch.cuda.Event | None = None
    pool_reserved_after: dict[str, int] = dataclasses.field(default_factory=dict)
    pool_live_after: dict[str, int] = dataclasses.field(default_factory=dict)


class GraphedRegion:
    """A layer region routed through the graph session.

    Args:
        module: The layer (or model, for the loss head) the region belongs to.
        method_name: Name of the method to graph (``forward`` for the whole layer).
        fn: The method itself, bound to ``module`` (the class's, not a routed one).
        name: Display name, e.g. ``decoder.layers.3.attn``.
        index: Position of the region in the session's list (its id in events).
        shared_params: Parameters that eager code differentiates too (see the module
            docstring). The graph never marks them complete: its part goes to
            ``param.grad``, or with gradient-accumulation fusion into ``main_grad``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        method_name: str,
        fn: Callable,
        name: str,
        index: int,
        shared_params: Sequence[torch.nn.Parameter] = (),
    ):
        self.module = module
        self.method_name = method_name
        self.fn = fn
        self.name = name
        self.index = index
        self._signature = inspect.signature(self.fn)
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in self._signature.parameters.values())
        self._names: list[str] | None = list(self._signature.parameters) if plain else None
        # Filled by the recording iteration.
        self.arg_meta: list[ArgMeta] | None = None
        self.sources: list[Source] = []
        self.output_is_tuple = False
        self.output_requires_grad: list[bool] = []
        self.output_meta: list[TensorMeta] = []
        self.num_outputs = 0
        self.shared_params: list[torch.nn.Parameter] = list(shared_params)
        # Filled by capture.
        self.params: list[torch.nn.Parameter] = []  # main_grad written by the backward graph
        # Shared parameters whose part the graph fuses into main_grad (gradient-accumulation
        # fusion): DDP waits for our event, but eager autograd says when they are complete.
        self.fused_shared_params: list[torch.nn.Parameter] = []
        self.slots: dict[int, SlotGraphs] = {}
        self.replays = 0
        self.capture_seconds = 0.0
        self.transients_routed = 0  # forward ops whose allocations were captured into the backward pool

    # ------------------------------------------------------------------ arguments
    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Positional arguments with defaults filled, so every call looks the same."""
        names, n = self._names, len(args)
        if names is not None and len(kwargs) == len(names) - n and all(k in kwargs for k in names[n:]):
            return tuple(args) + tuple(kwargs[k] for k in names[n:])  # every call of a step: no inspect
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def check_args(self, args: Sequence[Any]) -> None:
        """Raises ``ValueError`` naming what changed since capture (shape, dtype, value)."""
        meta = arg_metadata(args)
        if meta == self.arg_meta:
            return
        names = list(self._signature.parameters)
        for i, (got, want) in enumerate(zip(meta, self.arg_meta)):
            if got != want:
                raise ValueError(
                    f"CUDA graph for {self.name}: argument {names[i] if i < len(names) else i!r} changed since "
                    f"capture: captured {_describe(want)}, got {_describe(got)}. Graphs are captured for one "
                    "shape (sequence length, micro batch) and dtype; keep them fixed, or run with --cuda-graph-impl none."
                )
        if len(meta) != len(self.arg_meta):
            raise ValueError(
                f"CUDA graph for {self.name}: called with {len(meta)} arguments, captured with {len(self.arg_meta)}"
            )

    def split_outputs(self, out) -> tuple[torch.Tensor, ...]:
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"CUDA graph region {self.name} must return tensors, got {type(o).__name__}")
        return outs

    def join_outputs(self, outs: Sequence[torch.Tensor]):
        return tuple(outs) if self.output_is_tuple else outs[0]

    @property
    def input_requires_grad(self) -> list[bool]:
        return [isinstance(m, TensorMeta) and m.requires_grad for m in self.arg_meta]

    @property
    def has_backward(self) -> bool:
        return any(self.output_requires_grad)

    # ------------------------------------------------------------------ recording
    def note_call(self, args: tuple[Any, ...], out) -> tuple[torch.Tensor, ...]:
        """Learns the output signature from an eager call (recording)."""
        outs = self.split_outputs(out)
        self.output_is_tuple = isinstance(out, (tuple, list))
        self.num_outputs = len(outs)
        self.output_requires_grad = [o.requires_grad for o in outs]
        self.output_meta = [TensorMeta(o.shape, o.dtype, o.device, False) for o in outs]
        return outs

    # ------------------------------------------------------------------ capture
    def sample_args(self, make_tensor: Callable[[TensorMeta], torch.Tensor]) -> list[Any]:
        return [make_tensor(m) if isinstance(m, TensorMeta) else m.value for m in self.arg_meta]

    def discover_params(self, args: list[Any]) -> None:
        """Finds the parameters this region uses, from one eager forward+backward."""
        candidates = [p for p in self.module.parameters() if p.requires_grad]
        if not self.has_backward:
            self.params = []
            return
        outs = self.split_outputs(self.fn(*args))
        reached = _leaves_reached(outs)  # includes weights whose wgrad is fused (no autograd grad)
        grads = self._grad(outs, args, candidates)
        has_grad = {id(p) for p, g in zip(candidates, grads[len(self._grad_inputs(args)) :]) if g is not None}
        used = [p for p in candidates if id(p) in reached or id(p) in has_grad]
        shared = {id(p) for p in self.shared_params}
        self.shared_params = [p for p in used if id(p) in shared and id(p) in has_grad]
        self.fused_shared_params = [p for p in used if id(p) in shared and id(p) not in has_grad]
        self.params = [p for p in used if id(p) not in shared]
        missing = [p for p in self.params if not hasattr(p, "main_grad")]
        if missing:
            raise RuntimeError(
                f"CUDA graph for {self.name}: parameters without main_grad; wrap the model in "
                "DistributedDataParallel before capturing (graphs add weight gradients to main_grad)."
            )

    def _wgrad_params(self) -> list[torch.nn.Parameter]:
        # Fused weights return no gradient, but asking for them runs their backward (and
        # its main_grad accumulation) even when no input needs a gradient.
        return self.params + self.shared_params + self.fused_shared_params

    def _grad_inputs(self, args: Sequence[Any]) -> list[torch.Tensor]:
        return [a for a, rg in zip(args, self.input_requires_grad) if rg]

    def _grad(self, outs, args, params, grad_outputs=None):
        # Sample gradients of ones for warm-up; the static grad_output buffers at capture.
        picked = [j for j, rg in enumerate(self.output_requires_grad) if rg]
        outputs = [outs[j] for j in picked]
        if grad_outputs is None:
            grads_out = [torch.ones_like(o) for o in outputs]
        else:
            grads_out = [grad_outputs[j] for j in picked]
        return torch.autograd.grad(outputs, self._grad_inputs(args) + list(params), grads_out, allow_unused=True)

    def warmup(self, args: list[Any], steps: int) -> None:
        for _ in range(steps):
            outs = self.split_outputs(self.fn(*args))
            if self.has_backward:
                self._grad(outs, args, self._wgrad_params())
            del outs

    def capture_forward(self, slot: int, args: list[Any], pool, stream, mode=None) -> tuple[torch.Tensor, ...]:
        """Captures the forward graph of ``slot`` on ``args`` (static buffers or their leaf aliases); ``mode``: a
        dispatch mode the forward runs under (``transients.TransientRouter``)."""
        graphs = self.slots.setdefault(slot, SlotGraphs())
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
            try:
                with mode if mode is not None else contextlib.nullcontext():
                    outs = self.split_outputs(self.fn(*args))
            finally:
                graph.capture_end()
        self.capture_seconds += time.perf_counter() - start
        graphs.fwd_graph = graph
        if self.has_backward:
            # Roots and leaves of the backward capture; the plan decides everything else.
            graphs.capture_args = list(args)
            graphs.fwd_outputs = outs
        return outs

    def capture_backward(
        self, slot: int, grad_outputs: list[torch.Tensor | None], pool, stream, copy_into=None
    ) -> list[torch.Tensor]:
        """Captures dgrad + wgrad of ``slot``; wgrads are added to ``main_grad`` inside the graph.

        ``copy_into``: per dgrad, None or a buffer (outside ``pool``) the graph copies
        that dgrad into; the buffer is then returned in its place.
        """
        graphs = self.slots[slot]
        graph = torch.cuda.CUDAGraph()
        args, outs = graphs.capture_args, graphs.fwd_outputs
        n_in = len(self._grad_inputs(args))
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
            try:
                grads = self._grad(outs, args, self._wgrad_params(), grad_outputs)
                for p, g in zip(self.params, grads[n_in:]):
                    if g is not None:
                        p.main_grad.add_(g)
                if copy_into is not None:
                    grads = list(grads)
                    for i, dst in enumerate(copy_into):
                        if dst is not None and grads[i] is not None:
                            dst.copy_(grads[i])
                            grads[i] = dst
            finally:
                graph.capture_end()
        self.capture_seconds += time.perf_counter() - start
        graphs.bwd_graph = graph
        # Read by eager autograd after every replay, until DDP folds it: held for good.
        n_params = len(self.params)
        graphs.shared_grads = list(grads[n_in + n_params : n_in + n_params + len(self.shared_params)])
        dgrads = list(grads[:n_in])
        del grads
        # The autograd graph of the forward capture is freed now: its saved tensors go
        # back to the pool. Drop our own holds on the capture-time arguments too.
        graphs.capture_args = None
        graphs.fwd_outputs = None
        return dgrads

    def finish_capture(self, slot: int, inputs, outputs, grad_outputs, grad_inputs) -> None:
        """Bakes the final (weak or strong) buffer objects used at every replay of ``slot``."""
        graphs = self.slots[slot]
        graphs.capture_args = None
        graphs.fwd_outputs = None
        graphs.replay_inputs = inputs
        graphs.replay_outputs = outputs
        graphs.replay_grad_outputs = grad_outputs
        graphs.replay_grad_inputs = grad_inputs
        graphs.wgrad_event = torch.cuda.Event()

    def num_graphs(self) -> int:
        return sum((g.fwd_graph is not None) + (g.bwd_graph is not None) for g in self.slots.values())

    # ------------------------------------------------------------------ replay
    def replay_forward(self, slot: int, args: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        graphs = self.slots[slot]
        for i, static, copy in graphs.replay_inputs:
            a = args[i]
            if a.data_ptr() == static.data_ptr():
                continue
            if not copy:
                raise RuntimeError(
                    f"CUDA graph for {self.name}: input {i} was captured as the output buffer of the region "
                    "before it, but another tensor arrived at replay; the data flow between graphed regions "
                    "changed since capture."
                )
            static.copy_(a)
        graphs.fwd_graph.replay()
        self.replays += 1
        return tuple(o.detach() for o in graphs.replay_outputs)

    def replay_backward(
        self, slot: int, grads: Sequence[torch.Tensor | None], after_turn: bool = False
    ) -> tuple[torch.Tensor | None, ...]:
        """Replays the backward graph of ``slot``; returns the dgrads for autograd. ``after_turn``: an
        eager turn made ``grads`` in the backward pool, where one may sit partly in a released static
        input's block; such a one is copied in through a clone.

        Afterwards the caller marks ``self.params`` ready with ``slot``'s wgrad event.
        """
        graphs = self.slots[slot]
        for g, static_copy in zip(grads, graphs.replay_grad_outputs):
            if static_copy is None:
                continue
            static, _ = static_copy
            if g is None:
                static.zero_()
            elif g.data_ptr() != static.data_ptr():
                static.copy_(g.clone() if after_turn and _overlaps(g, static) else g)
        graphs.bwd_graph.replay()
        # Dgrads for eager code leave as copies (before debug mode poisons the buffers).
        dgrads = iter([d if d is None else d.clone() if copy else d.detach() for d, copy in graphs.replay_grad_inputs])
        for p, g in zip(self.shared_params, graphs.shared_grads):
            if p.grad is not None:
                raise RuntimeError(
                    f"CUDA graph for {self.name}: the shared parameter {tuple(p.shape)} still has a .grad from "
                    "before this backward; DDP folds .grad into main_grad after every micro-batch, so "
                    "something else kept it (a graphed backward cannot reproduce eager's summation then)."
                )
            p.grad = g  # eager autograd adds its own contribution in place, as AccumulateGrad does
        graphs.wgrad_event.record()
        return tuple(next(dgrads) if rg else None for rg in self.input_requires_grad)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storages behind ``a`` and ``b`` share any byte."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() < sb.data_ptr() + sb.nbytes() and sb.data_ptr() < sa.data_ptr() + sa.nbytes()


def _leaves_reached(outputs: Sequence[torch.Tensor]) -> set:
    """ids of the leaf tensors (parameters, inputs) the autograd graph of ``outputs`` reaches."""
    found, seen = set(), set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            found.add(id(variable))
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return found
