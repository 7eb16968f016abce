"""Scratch blocks: a forward's working memory, kept in the backward graphs' pool.

A scratch block (:func:`scratch`) is a stretch of a forward whose allocations all die inside it;
its results go into tensors made before it. The Mamba scan's slices are such blocks (512 MiB of
decay matrices at a time, eagerly). Between forward graphs the backward graphs' pool holds
nothing, so:

* Eager blocks allocate in that pool, through the eager turns' router (``turn.py``), wherever the
  turns open and no forward graph's output waits in that pool over a forward
  (``forwards_in_backward_pool``). Eager Mamba layers then keep their scan's forward working
  memory there, as their backward's is in the turns between backward graphs.
* A forward graph's blocks are captured into that pool too, with one slot
  (:func:`capture_scratch_into`): its pools hand memory out in replay order, so the slices die
  before anything captured later uses their memory. In the forward's own pool the last layer's
  slices would stay reserved beside every activation.
* The recording iteration watches every block (``turn.TurnWatch``); if one leaves a tensor alive,
  no block moves, with a warning.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref

from megatron.core.transformer.cuda_graphs.pool import GraphPool, capture_detour, capture_detour_possible
from megatron.core.transformer.cuda_graphs.turn import TurnWatch
from megatron.core.transformer.recompute import capturing

_here = threading.local()  # per thread: the pools of the forward capture in progress (capture_scratch_into)

_owner = None  # a weak reference to the session whose scratch blocks route (or are watched)


def own_scratch(session) -> None:
    """``session`` takes the scratch blocks from now on (the last session attached on CUDA)."""
    global _owner
    _owner = weakref.ref(session)


def disown_scratch(session) -> None:
    global _owner
    if _owner is not None and _owner() is session:
        _owner = None


def owning_session():
    """The session that takes the scratch blocks, or None."""
    return _owner() if _owner is not None else None


def scratch_routes() -> bool:
    """Whether a :func:`scratch` block run now, outside a capture, would allocate in the backward
    graphs' pool: an eager forward of a graphed run whose scratch blocks opened."""
    owner = owning_session()
    return owner is not None and owner._scratch_open


@contextlib.contextmanager
def scratch():
    """A block of a forward whose allocations all die inside it (working memory; its results are
    written into tensors made before it). With a graph session whose turns open, it allocates in the
    backward graphs' pool, idle during a forward (module docstring); so does a forward graph's,
    captured under :func:`capture_scratch_into`. Otherwise it changes nothing."""
    if capturing():
        pools = getattr(_here, "capture_scratch", None)
        with capture_detour(*pools) if pools is not None else contextlib.nullcontext():
            yield
        return
    owner = owning_session()
    if owner is None:
        yield
        return
    with owner._scratch_block():
        yield


@contextlib.contextmanager
def capture_scratch_into(capturing: GraphPool, pool: GraphPool):
    """While a forward graph captures into ``capturing``: the :func:`scratch` blocks it runs allocate
    in ``pool`` (the backward graphs'). Safe where the pool's memory is handed out in execution
    order (one slot: capture order is replay order) and the recording saw every scratch block die
    inside it: the graph's working memory is then dead before anything captured later uses it."""
    _here.capture_scratch = (capturing, pool)
    try:
        yield
    finally:
        _here.capture_scratch = None


class ScratchHooks:
    """The scratch blocks' side of a graph session (a mixin of ``GraphSession``, whose state it uses:
    the turns' router ``_turn``, ``recording``, ``captures_next``, ``forwards_in_backward_pool``)."""

    _scratch_seen = False  # recording: a scratch block ran
    _scratch_escaped: list[str] | None = None  # recording: what the first leaky scratch block left alive
    _scratch_open = False  # after capture: scratch blocks allocate in the backward pool
    scratch_captured = False  # the forward graphs' scratch blocks were captured into the backward pool

    @contextlib.contextmanager
    def _scratch_block(self):
        """:func:`scratch` for this session: watched while recording before a capture; after it,
        routed into the backward pool if the scratch opened and no turn routes a thread now."""
        if self.recording and self.captures_next:
            watch = TurnWatch("cuda")
            with watch:
                watch.start()
                yield
            self._scratch_seen = True
            if watch.alive and self._scratch_escaped is None:
                self._scratch_escaped = [what for what, _ in watch.alive.values()]
            return
        router = self._turn
        if not self._scratch_open or router is None or router.routing():
            yield
            return
        router.open()
        try:
            yield
        finally:
            router.close()

    def _capture_scratch(self, shared_backward: bool, slots: int) -> bool:
        """Before capture: whether the forward graphs' scratch blocks go into the backward pool
        (:func:`capture_scratch_into`): one slot, whose pools hand memory out in replay order, with a
        backward pool of its own, and every block the recording saw died inside it."""
        self.scratch_captured = (
            shared_backward
            and slots == 1
            and self._scratch_seen
            and not self._scratch_escaped
            and capture_detour_possible()
        )
        return self.scratch_captured

    def _open_scratch(self) -> None:
        """After capture: scratch blocks route where the turns do, if every one the recording saw left
        nothing alive and no forward graph's output waits in the backward pool over a forward."""
        self._scratch_open = False
        if self._turn is None or not self._scratch_seen or self.forwards_in_backward_pool:
            return
        if self._scratch_escaped:
            warnings.warn(
                "CUDA graphs: a scratch block of the forward left tensors alive "
                f"({'; '.join(dict.fromkeys(self._scratch_escaped))}), so scratch blocks stay in the eager cache.",
                stacklevel=5,
            )
            return
        self._scratch_open = True

    def _close_scratch(self) -> None:
        disown_scratch(self)
        self._scratch_open = False
