"""``--cuda-graph-impl full_iteration``: one training iteration's forward and backward as one CUDA graph.

Megatron's full-iteration graph: every micro-batch's forward and backward of a global
batch, and the folding of their gradients into ``main_grad``, are captured once and
replayed each iteration. The optimizer step, the gradient reduction over data-parallel
ranks, the NaN guard and logging stay eager around it.

Data flow. A replay cannot pull batches: before each replay the iteration's micro-batches
are fetched on the host as usual and copied into static input buffers, one set per
micro-batch, that the captured forward steps read. The graph's outputs (the loss and the
schedule's metrics) live in its pool and are copied out after each replay.

Lifecycle. The first ``warmup`` iterations run eagerly (at least one: lazy
initialisation, cuBLAS workspaces and the eager cache settle there); the next one
captures and then replays. A global batch with another micro-batch count
(``--rampup-batch-size``) captures a graph of its own into the same pool: the graphs
never run at once, so they share its memory.

Unusual here:
- Capture records and does not run, so the capturing iteration's work is its first
  replay; the eager cache is handed back to the driver before capture, so the pool does
  not stack on top of the warm-up's cached activations.
- DDP's fold of ``.grad`` into ``main_grad`` is captured with its scratch buffers,
  which DDP keeps for as long as the same parameters arrive with gradients: every
  iteration here, since nothing runs an eager backward once the graph exists.
- The schedule's Python runs only at capture. Everything it does each iteration must
  therefore be device work or state that stays true across replays; the run
  configuration refuses what is not (pipeline schedules, MoE token counts on the host,
  fp16's host-side loss scale, re-runs).
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from megatron.core.config_utils import require
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.core.transformer.cuda_graphs.pool import GraphPool
from megatron.core.transformer.cuda_graphs.streams import side_stream

Batch = dict[str, torch.Tensor]
Outputs = tuple[torch.Tensor, dict[str, torch.Tensor]]


class _Captured:
    """One micro-batch count's graph, its static inputs and its outputs."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[Batch], outputs: Outputs, seconds: float):
        self.graph, self.inputs, self.outputs, self.seconds = graph, inputs, outputs, seconds


class FullIterationGraph:
    """Runs ``step(next_batch) -> (loss, metrics)`` eagerly, then as a replayed CUDA graph.

    Args:
        warmup: Eager iterations before the capture (``--cuda-graph-warmup-steps``; at
            least one runs).
        log: Called with one line when a graph is captured.
    """

    def __init__(self, warmup: int, log: Callable[[str], None] = print):
        self.warmup = max(int(warmup), 1)
        self.log = log
        self.eager_runs = 0
        self.graphs: dict[int, _Captured] = {}
        self.pool: GraphPool | None = None  # one memory pool for every micro-batch count's graph

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def close(self) -> None:
        """Drops the graphs and the pool (the trainer's ``close``)."""
        self.graphs.clear()
        if self.pool is not None:
            self.pool.close()

    def stats(self) -> dict[str, float]:
        """What the memory line reports, with the partial graphs' keys (after a capture;
        walks the allocator's segments). The outputs live in the pool; the static inputs
        (token ids and masks) outside it."""
        pool = self.pool.stats()
        return {
            "pool_reserved_bytes": pool.reserved_bytes,
            "pool_live_bytes": pool.live_bytes,
            "strong_bytes": 0,
            "graphs": self.num_graphs,
            "capture_seconds": sum(g.seconds for g in self.graphs.values()),
        }

    def run(
        self, step: Callable[[Callable[[], Batch]], Outputs], batches: list[Batch], then: Callable[[], None]
    ) -> Outputs:
        """One iteration over ``batches`` (the global batch's micro-batches, on the device).

        Args:
            step: Runs the schedule, pulling micro-batches from its argument.
            batches: The micro-batches.
            then: Runs right after ``step``, in the graph too: DDP's fold of the last
                micro-batch's ``.grad`` into ``main_grad``. After a replay no ``.grad``
                exists for eager code to fold, so the fold must be captured.
        """

        def iteration(next_batch):
            results = step(next_batch)
            then()
            return results

        if not self.graphs and self.eager_runs < self.warmup:
            self.eager_runs += 1
            feed = iter(batches)
            return iteration(lambda: next(feed))
        captured = self.graphs.get(len(batches))
        if captured is None:
            captured = self.graphs[len(batches)] = self._capture(iteration, batches)
        else:
            _copy_into(captured.inputs, batches)
        captured.graph.replay()
        loss, metrics = captured.outputs
        return loss.clone(), {name: value.clone() for name, value in metrics.items()}

    def _capture(self, step, batches: list[Batch]) -> _Captured:
        inputs = [{name: value.clone() for name, value in batch.items()} for batch in batches]
        feed = iter(inputs)
        graph = torch.cuda.CUDAGraph()
        get_rng_tracker().register_with_graph(graph)  # the default generator registers itself
        if self.pool is None:
            self.pool = GraphPool()
        caller = torch.cuda.current_stream()
        stream = side_stream() if caller == torch.cuda.default_stream() else caller
        gc_enabled = gc.isenabled()
        gc.collect()
        gc.disable()  # a collection inside the capture could free tensors the graph uses
        start = time.perf_counter()
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the warm-up's cached activations go back before the pool grows
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self.pool.handle, capture_error_mode="thread_local")
                try:
                    outputs = step(lambda: next(feed))
                except RuntimeError as err:
                    raise RuntimeError(
                        f"--cuda-graph-impl full_iteration: capturing the iteration failed ({err}). Something in "
                        "the forward or backward step waits on the host, which a CUDA graph cannot hold; use "
                        "--cuda-graph-impl local for partial graphs instead."
                    ) from err
                finally:
                    graph.capture_end()
            caller.wait_stream(stream)
        finally:
            if gc_enabled:
                gc.enable()
        seconds = time.perf_counter() - start
        loss, metrics = outputs
        _check_outputs(loss, metrics)
        captured = _Captured(graph, inputs, outputs, seconds)
        self.log(
            f"> full-iteration CUDA graph captured for {len(batches)} micro-batch(es) in {seconds:.2f} s; "
            f"graph pool {self.pool.stats().reserved_bytes / 2**20:.0f} MiB"
        )
        return captured


def _copy_into(statics: list[Batch], batches: list[Batch]) -> None:
    for mb, (static, batch) in enumerate(zip(statics, batches)):
        if static.keys() != batch.keys():
            raise RuntimeError(
                f"--cuda-graph-impl full_iteration: micro-batch {mb} has the fields {sorted(batch)}, the captured "
                f"graph reads {sorted(static)}; the data must keep its fields from iteration to iteration."
            )
        for name, value in batch.items():
            buffer = static[name]
            if value.shape != buffer.shape or value.dtype != buffer.dtype:
                raise RuntimeError(
                    f"--cuda-graph-impl full_iteration: {name} of micro-batch {mb} is {value.dtype} "
                    f"{tuple(value.shape)}, the captured graph reads {buffer.dtype} {tuple(buffer.shape)}; "
                    "--seq-length and --micro-batch-size must stay fixed."
                )
            buffer.copy_(value, non_blocking=True)


def _check_outputs(loss: Any, metrics: Any) -> None:
    """The schedule's results must be device tensors: a Python value would be the capture's, frozen."""
    values = [loss, *metrics.values()] if isinstance(metrics, dict) else [loss, metrics]
    for value in values:
        if not isinstance(value, torch.Tensor) or not value.is_cuda:
            raise RuntimeError(
                "--cuda-graph-impl full_iteration: the forward step returned a value that is not a CUDA tensor "
                f"({type(value).__name__}); a replay could not update it."
            )


def check_config(cfg) -> None:
    """Raises ``ValueError`` for what a full-iteration graph cannot hold (``cfg``: a resolved RunConfig)."""
    impl = "--cuda-graph-impl full_iteration"
    fix = "use --cuda-graph-impl local (partial graphs) instead"
    require(
        cfg.parallel.pipeline_model_parallel_size == 1,
        f"{impl} with --pipeline-model-parallel-size > 1 is not supported yet: the pipeline schedule's "
        f"exchanges are host-driven; {fix}.",
    )
    require(
        not cfg.moe.enabled,
        f"{impl} with --num-experts is not supported yet: the token dispatcher reads expert token counts on "
        f"the host; {fix} (--cuda-graph-scope attn moe_router moe_preprocess).",
    )
    require(
        not cfg.precision.fp16,
        f"{impl} with --fp16 is not supported yet: the dynamic loss scale is a host value a graph would "
        f"freeze; use --bf16, or {fix}.",
    )


def build(config, device: torch.device, log: Callable[[str], None]) -> FullIterationGraph | None:
    """The trainer's full-iteration graph (``config``: CudaGraphConfig), or None: not asked for, or no CUDA."""
    if not config.full_iteration:
        return None
    if device.type != "cuda":
        warnings.warn(
            "--cuda-graph-impl full_iteration: CUDA is not available, so CUDA graphs are off and the run is eager.",
            stacklevel=2,
        )
        return None
    return FullIterationGraph(config.cuda_graph_warmup_steps, log=log)
