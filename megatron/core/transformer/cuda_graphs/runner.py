"""One graphable region: its recording, warm-up, capture and replay.

A region is a bound method of a layer (``forward`` for a whole layer, or e.g.
``_forward_attention``) whose tensor arguments and outputs become static buffers. The
manager decides the order and the buffers (``buffers.py``); this file does the torch
work for one region. Parameters are not graph inputs: their addresses are stable, and
the backward graph adds their gradients into ``param.main_grad`` itself. A *shared*
parameter (one that eager code also differentiates, e.g. a tied embedding used by the
loss head) is the exception: its gradient lands in a static buffer that becomes
``param.grad``, so autograd adds the eager contribution to it in the parameter's dtype
before DDP folds it into ``main_grad``, exactly as in an eager run. With
gradient-accumulation fusion the region's part goes into ``main_grad`` inside the graph
(as eager does) and DDP only waits on the graph's event for it.
"""

import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron.core.transformer.cuda_graphs.buffers import BWD, FWD, OWN, Event, Source
from megatron.core.transformer.cuda_graphs.replay import RecordBackward

# Strides are not part of the signature: static buffers are contiguous and a copy into
# them accepts any layout.
TensorMeta = tuple[torch.Size, torch.dtype, torch.device, bool]


def _meta(t: torch.Tensor) -> TensorMeta:
    return (t.shape, t.dtype, t.device, t.requires_grad)


def _describe(meta) -> str:
    if meta[0] == "value":
        return repr(meta[1])
    shape, dtype, device, rg = meta[1]
    return f"tensor(shape={tuple(shape)}, dtype={dtype}, device={device}, requires_grad={rg})"


class GraphedRegion:
    """A layer region routed through the graph manager.

    Args:
        manager: The owning ``CudaGraphManager``.
        module: The layer the region belongs to.
        method_name: Name of the bound method to graph (``forward`` for the whole layer).
        name: Display name, e.g. ``decoder.layers.3.attn``.
        index: Position of the region in the manager's list (its id in events).
        shared_params: Parameters that eager code differentiates too (see the module
            docstring). The graph never marks them complete: its part goes to
            ``param.grad``, or with gradient-accumulation fusion into ``main_grad``.
    """

    def __init__(
        self,
        manager,
        module: torch.nn.Module,
        method_name: str,
        name: str,
        index: int,
        shared_params: Sequence[torch.nn.Parameter] = (),
    ):
        self.manager = manager
        self.module = module
        self.method_name = method_name
        self.fn: Callable = getattr(module, method_name)
        self.name = name
        self.index = index
        self._signature = inspect.signature(self.fn)
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in self._signature.parameters.values())
        self._names: list[str] | None = list(self._signature.parameters) if plain else None
        # Filled by the recording iteration.
        self.arg_meta: list[Any] | None = None  # per positional arg: ("tensor", TensorMeta) | ("value", v)
        self.sources: list[Source] = []
        self.output_is_tuple = False
        self.output_requires_grad: list[bool] = []
        self.output_meta: list[TensorMeta] = []
        self.num_outputs = 0
        self.shared_params: list[torch.nn.Parameter] = list(shared_params)
        # Filled by capture.
        self.params: list[torch.nn.Parameter] = []  # main_grad written by the backward graph
        self.shared_grads: list[torch.Tensor] = []  # static wgrad buffers of shared_params
        # Shared parameters whose part the graph fuses into main_grad (gradient-accumulation
        # fusion): DDP waits for our event, but eager autograd says when they are complete.
        self.fused_shared_params: list[torch.nn.Parameter] = []
        self.fwd_graph: torch.cuda.CUDAGraph | None = None
        self.bwd_graph: torch.cuda.CUDAGraph | None = None
        self._capture_args: list[Any] | None = None
        self._fwd_outputs: tuple[torch.Tensor, ...] | None = None
        self.replay_inputs: list[tuple[int, torch.Tensor, bool]] = []  # (arg index, static, copy?)
        self.replay_outputs: list[torch.Tensor] = []
        self.replay_grad_outputs: list[tuple[torch.Tensor, bool] | None] = []
        self.replay_grad_inputs: list[tuple[torch.Tensor, bool]] = []  # (static dgrad, copy out?)
        self.wgrad_event: torch.cuda.Event | None = None
        self.replays = 0
        self.capture_seconds = 0.0
        self.pool_reserved_after: dict[str, int] = {}
        self.pool_live_after: dict[str, int] = {}

    # ------------------------------------------------------------------ arguments
    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Positional arguments with defaults filled, so every call looks the same."""
        names, n = self._names, len(args)
        if names is not None and len(kwargs) == len(names) - n and all(k in kwargs for k in names[n:]):
            return tuple(args) + tuple(kwargs[k] for k in names[n:])  # every call of a step: no inspect
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    @staticmethod
    def arg_metadata(args: Sequence[Any]) -> list[Any]:
        return [("tensor", _meta(a)) if isinstance(a, torch.Tensor) else ("value", a) for a in args]

    def check_args(self, args: Sequence[Any]) -> None:
        """Raises ``ValueError`` naming what changed since capture (shape, dtype, value)."""
        meta = self.arg_metadata(args)
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

    def _split_outputs(self, out) -> tuple[torch.Tensor, ...]:
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"CUDA graph region {self.name} must return tensors, got {type(o).__name__}")
        return outs

    def _join_outputs(self, outs: Sequence[torch.Tensor]):
        return tuple(outs) if self.output_is_tuple else outs[0]

    # ------------------------------------------------------------------ recording
    def record_forward(self, args: tuple[Any, ...]):
        """Eager forward that also records metadata, sources and the backward order."""
        meta = self.arg_metadata(args)
        if self.arg_meta is None:
            self.arg_meta = meta
            self.sources = [
                self.manager.source_of(a, self.index, i) if isinstance(a, torch.Tensor) else OWN
                for i, a in enumerate(args)
            ]
        elif meta != self.arg_meta:
            self.check_args(args)
        out = self.fn(*args)
        outs = self._split_outputs(out)
        self.output_is_tuple = isinstance(out, (tuple, list))
        self.num_outputs = len(outs)
        self.output_requires_grad = [o.requires_grad for o in outs]
        self.output_meta = [(o.shape, o.dtype, o.device, False) for o in outs]
        self.manager.record_event(Event(FWD, self.index))
        if any(self.output_requires_grad):
            idx = [j for j, rg in enumerate(self.output_requires_grad) if rg]
            wrapped = RecordBackward.apply(
                lambda: self.manager.record_event(Event(BWD, self.index)), *[outs[j] for j in idx]
            )
            outs = list(outs)
            for j, w in zip(idx, wrapped):
                outs[j] = w
        for j, o in enumerate(outs):
            self.manager.note_output(o, self.index, j)
        return self._join_outputs(outs)

    @property
    def input_requires_grad(self) -> list[bool]:
        return [m[0] == "tensor" and m[1][3] for m in self.arg_meta]

    # ------------------------------------------------------------------ capture
    def sample_args(self, make_tensor: Callable[[int, TensorMeta], torch.Tensor]) -> list[Any]:
        return [make_tensor(i, m[1]) if m[0] == "tensor" else m[1] for i, m in enumerate(self.arg_meta)]

    def discover_params(self, args: list[Any]) -> None:
        """Finds the parameters this region uses, from one eager forward+backward."""
        candidates = [p for p in self.module.parameters() if p.requires_grad]
        if not any(self.output_requires_grad):
            self.params = []
            return
        outs = self._split_outputs(self.fn(*args))
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
            outs = self._split_outputs(self.fn(*args))
            if any(self.output_requires_grad):
                self._grad(outs, args, self._wgrad_params())
            del outs

    def capture_forward(self, args: list[Any], pool, stream) -> tuple[torch.Tensor, ...]:
        """Captures the forward graph on ``args`` (static buffers or their leaf aliases)."""
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
            try:
                outs = self._split_outputs(self.fn(*args))
            finally:
                graph.capture_end()
        self.capture_seconds += time.perf_counter() - start
        self.fwd_graph = graph
        if any(self.output_requires_grad):
            # Roots and leaves of the backward capture; the plan decides everything else.
            self._capture_args = list(args)
            self._fwd_outputs = outs
        return outs

    def capture_backward(self, grad_outputs: list[torch.Tensor | None], pool, stream) -> list[torch.Tensor | None]:
        """Captures dgrad + wgrad; wgrads are added to ``main_grad`` inside the graph."""
        graph = torch.cuda.CUDAGraph()
        args, outs = self._capture_args, self._fwd_outputs
        n_in = len(self._grad_inputs(args))
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
            try:
                grads = self._grad(outs, args, self._wgrad_params(), grad_outputs)
                for p, g in zip(self.params, grads[n_in:]):
                    if g is not None:
                        p.main_grad.add_(g)
            finally:
                graph.capture_end()
        self.capture_seconds += time.perf_counter() - start
        self.bwd_graph = graph
        # Read by eager autograd after every replay, until DDP folds it: held for good.
        self.shared_grads = list(grads[n_in + len(self.params) : n_in + len(self.params) + len(self.shared_params)])
        dgrads = list(grads[:n_in])
        del grads
        # The autograd graph of the forward capture is freed now: its saved tensors go
        # back to the pool. Drop our own holds on the capture-time arguments too.
        self._capture_args = None
        self._fwd_outputs = None
        return dgrads

    def finish_capture(self, inputs, outputs, grad_outputs, grad_inputs) -> None:
        """Bakes the final (weak or strong) buffer objects used at every replay."""
        self._capture_args = None
        self._fwd_outputs = None
        self.replay_inputs = inputs
        self.replay_outputs = outputs
        self.replay_grad_outputs = grad_outputs
        self.replay_grad_inputs = grad_inputs
        self.wgrad_event = torch.cuda.Event()

    # ------------------------------------------------------------------ replay
    def replay_forward(self, args: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        self.manager.check_order(Event(FWD, self.index), self)
        for i, static, copy in self.replay_inputs:
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
        self.fwd_graph.replay()
        self.manager.after_replay()
        self.replays += 1
        return tuple(o.detach() for o in self.replay_outputs)

    def replay_backward(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        self.manager.check_order(Event(BWD, self.index), self)
        for g, slot in zip(grads, self.replay_grad_outputs):
            if slot is None:
                continue
            static, _ = slot
            if g is None:
                static.zero_()
            elif g.data_ptr() != static.data_ptr():
                static.copy_(g)
        self.bwd_graph.replay()
        # Dgrads for eager code leave as copies (before debug mode poisons the buffers).
        dgrads = iter([d if d is None else d.clone() if copy else d.detach() for d, copy in self.replay_grad_inputs])
        self.manager.after_replay()
        for p, g in zip(self.shared_params, self.shared_grads):
            if p.grad is not None:
                raise RuntimeError(
                    f"CUDA graph for {self.name}: the shared parameter {tuple(p.shape)} still has a .grad from "
                    "before this backward; DDP folds .grad into main_grad after every micro-batch, so "
                    "something else kept it (a graphed backward cannot reproduce eager's summation then)."
                )
            p.grad = g  # eager autograd adds its own contribution in place, as AccumulateGrad does
        if self.wgrad_event is not None:
            self.wgrad_event.record()
        self.manager.wgrads_ready(self.params, self.wgrad_event, self.fused_shared_params)
        return tuple(next(dgrads) if rg else None for rg in self.input_requires_grad)


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
