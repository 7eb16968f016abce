"""The feed: the block that makes a micro-batch's input to the layers (the embedding), allocated in
the backward graphs' pool.

Eagerly, the embedding's output lives in the eager cache until the model's forward ends, and the
layers' activations later reuse that memory. Graphed, the first forward graph copies it into its
static input and the activations go to the pools: the output sits in the eager cache on top of them
for the whole forward (what that costs: README, hybrid models). When a micro-batch's forward starts,
the backward graphs' pool holds no data (the backward pass before it has ended, and what the pool
keeps across it is allocated, never handed out), so the feed allocates there:

* Only where the backward graphs have a pool of their own, with one slot, no pipeline schedule, the
  eager turns allowed (``TurnHooks.eager_turn_allowed`` and ``MEGATRON_CG_EAGER_TURN`` not 0), no
  first eager turn (the memory it shapes in that pool would find the feed's output still alive),
  the first forward graph captured in its forward pool, and not under ``--cuda-graph-debug`` (which
  reads a region's inputs after its replay); only in training forwards with gradients on.
* Forward graphs may write into the backward pool as they replay (a Mamba layer's captured scan
  slices, the forwards captured next to their backward). So once the micro-batch's first forward
  graph has copied the feed's output in, nothing may read it again. The recording iteration
  watches every op (:class:`FeedWatch`) and leaves the feed in the eager cache if a tensor the feed
  made is read after the first graphed forward began, or is alive when the backward begins (autograd
  saved it: an eager first layer's norm, embedding dropout's mask). That is no error and needs no
  change from the user, so it says nothing; the pools' log line says when the feed is in the pool.
* The recording runs the first graphed region on a copy of what the feed made, as its replay runs on
  its static input: autograd's saved tensors then hold the copy, and the watch sees whether anything
  else keeps the feed's output.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.core.transformer.cuda_graphs.pool import allocate_into_pool
from megatron.core.transformer.cuda_graphs.scratch import owning_session
from megatron.core.transformer.cuda_graphs.transients import made_storages
from megatron.core.transformer.cuda_graphs.turn import enabled
from megatron.core.transformer.recompute import capturing


@contextlib.contextmanager
def feed(module: torch.nn.Module):
    """The block of ``module``'s forward that makes the layers' input (the embedding): with a graph
    session whose feed opened, a training forward's allocations in it go to the backward graphs'
    pool (module docstring); while recording, it is watched. Otherwise it changes nothing."""
    owner = owning_session()
    if owner is None or capturing() or not module.training or not torch.is_grad_enabled():
        yield
        return
    with owner._feed_block():
        yield


class FeedWatch(TorchDispatchMode):
    """Notes the storages the feed's ops make, and every later read of them while they live.

    Pushed at the recording iteration's first feed block, popped by the capture (autograd's threads
    run the backward under it too).

    Args:
        device_type: Storages of this device type count.
    """

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.in_block = False
        self.seen = False  # a feed block ran
        self.fed: dict[int, str] = {}  # storage data_ptr -> what made it (alive ones)
        self.graphed = False  # the micro-batch's first graphed forward began
        self.escaped: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_block:
            for storage, t in made_storages((args, kwargs), out, self.device_type):
                ptr = storage.data_ptr()
                if ptr not in self.fed:
                    self.fed[ptr] = f"{func} -> {tuple(t.shape)} {t.dtype}"
                    weakref.finalize(storage, self.fed.pop, ptr, None)
        elif self.graphed and self.fed:
            for t in tree_flatten((args, kwargs))[0]:
                if self._fed(t):
                    self.escaped.append(f"{self.fed[t.untyped_storage().data_ptr()]}, read by {func}")
        return out

    def _fed(self, t) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.device.type == self.device_type
            and t.untyped_storage().data_ptr() in self.fed
        )

    def block_begins(self) -> None:
        """A feed block starts (a micro-batch's forward, before its first graphed region)."""
        if self.graphed:  # the micro-batch's graphs have begun, and no backward ended it since
            self.escaped.append("a feed block after the first forward graph of its micro-batch")
        self.in_block = self.seen = True

    def block_ends(self) -> None:
        self.in_block = False

    def region_forward(self, args: tuple) -> tuple:
        """A graphed region's recorded forward is next: for the micro-batch's first, its arguments
        the feed made are copied, as its replay copies them into its static inputs."""
        if self.graphed:
            return args
        args = tuple(a.clone() if self._fed(a) else a for a in args)
        self.graphed = True
        return args

    def backward_begins(self) -> None:
        """A backward event: the first after a micro-batch's graphs began finds whatever the feed made
        dead, or notes it; the next micro-batch's first graph is still to come."""
        if not self.graphed:
            return
        self.escaped += [f"{what}, alive when the backward began" for what in self.fed.values()]
        self.graphed = False


class FeedHooks:
    """The feed's side of a graph session (a mixin of ``GraphSession``, whose state it uses:
    ``recording``, ``captured``, ``captures_next``, ``backward_pool``, ``_turn``)."""

    _feed_watch: FeedWatch | None = None
    feed_open = False  # after capture: feed blocks allocate in the backward pool

    @contextlib.contextmanager
    def _feed_block(self):
        """:func:`feed` for this session: watched while recording before a capture; after it,
        routed into the backward pool if the feed opened and no turn routes a thread now."""
        if self.recording and self.captures_next:
            if self._feed_watch is None:
                self._feed_watch = FeedWatch("cuda")
                self._feed_watch.__enter__()
            self._feed_watch.block_begins()
            try:
                yield
            finally:
                self._feed_watch.block_ends()
            return
        if not (self.feed_open and self.captured) or (self._turn is not None and self._turn.routing()):
            yield
            return
        with allocate_into_pool(self.backward_pool):
            yield

    def _feed_region_forward(self, args: tuple) -> tuple:
        """Recording: a graphed region's forward runs next on ``args``."""
        return args if self._feed_watch is None else self._feed_watch.region_forward(args)

    def _feed_backward_begins(self) -> None:
        """Recording: a backward event is next."""
        if self._feed_watch is not None:
            self._feed_watch.backward_begins()

    def _end_feed_watch(self) -> FeedWatch | None:
        watch, self._feed_watch = self._feed_watch, None
        if watch is not None:
            watch.__exit__(None, None, None)
        return watch

    def _open_feed(self, watch: FeedWatch | None, first_turn: bool, first_forward_in_backward_pool: bool) -> None:
        """After capture: feed blocks allocate in the backward pool if the recording saw them and
        nothing read or kept their tensors past the first graph, and the session's layout allows it
        (module docstring)."""
        self.feed_open = (
            watch is not None
            and watch.seen
            and not watch.escaped
            and enabled()
            and self.eager_turn_allowed
            and self.backward_pool is not None
            and len(self.pools) == 1
            and self.recorded_schedule is None
            and not first_turn
            and not first_forward_in_backward_pool
            and not self.config.cuda_graph_debug
        )

    def _close_feed(self) -> None:
        self.feed_open = False
        try:
            self._end_feed_watch()
        except RuntimeError:  # not on top of the mode stack any more (an error in the recording)
            pass
