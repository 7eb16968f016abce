"""Forward transients: what a forward graph makes and frees inside itself, captured into the
backward graphs' own pool.

A forward graph captures into its slot's pool. What it leaves behind (outputs, tensors autograd
saves for backward) must stay there; what its ops make and free inside it (normalisation in fp32,
the MLP's pre-activation, attention's working tensors) stays reserved there too, on top of the
activations of the forwards before it, and once per slot, while eagerly every micro-batch reuses
one such set beside the memory the backward uses. Where the backward graphs have a pool of their
own, it holds nothing a forward graph could overwrite while the forward replays:

* several slots sharing it (``plan.backward_runs_alone``): each backward run replays alone, what
  it allocates is dead at its end (the dgrads a send reads later are copied into the slot's
  pool), and a forward that joins the pool (``plan.forwards_next_to_backward``) is followed at
  once by its own backward;
* one slot whose eager turns use it (``turn.py``): what a turn or an eager scratch block makes
  there dies before the next graph replays, and the recording checks that.

So the forwards' transients can live there, and every slot reuses one set, as eager does.

Which ops make only transients is learned right before the capture (:func:`log_forward`): one
more eager forward of the region on fresh sample inputs, as the capture's static buffers are, after
its warm-up. An op whose new storages are all dead when the forward returns made transients. The
capture (:class:`TransientRouter`) follows that log op by op (ops on the device only) and routes
those ops into the backward pool (``pool.capture_detour``); once an op differs from the log, it
routes nothing more. What a routed op made needs only to be dead when the capture ends: it then
lives only while this graph replays, when nothing else in the backward pool does. So the log is a
forecast, and the check after the capture is the guarantee: a routed storage still alive raises.

``MEGATRON_CG_FORWARD_TRANSIENTS=0`` keeps them in the slots' pools.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.core.transformer.cuda_graphs.pool import GraphPool, capture_detour, capture_detour_possible
from megatron.core.transformer.cuda_graphs.recorder import recording_region

OpRecord = tuple[str, bool]  # (the op, whether every storage it made died inside the forward)


def enabled() -> bool:
    return os.environ.get("MEGATRON_CG_FORWARD_TRANSIENTS", "1") != "0" and capture_detour_possible()


class OpLog(TorchDispatchMode):
    """While a forward runs eagerly: its ops on the device in order, and for each whether every
    storage it made was dead when the forward returned (:meth:`records`).

    Args:
        device_type: Ops and storages of this device type count (the pools' memory).
    """

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self._ops: list[list] = []  # [op, transient so far]
        self._alive: dict[int, int] = {}  # storage data_ptr -> the op that made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _on_device(args, kwargs, self.device_type):
            return out
        index = len(self._ops)
        self._ops.append([str(func), True])
        for storage, _ in made_storages((args, kwargs), out, self.device_type):
            ptr = storage.data_ptr()
            self._alive[ptr] = index
            weakref.finalize(storage, self._alive.pop, ptr, None)
        return out

    def records(self) -> list[OpRecord]:
        """The log as the forward's end finds it: an op that made a storage still alive is no transient."""
        for index in self._alive.values():
            self._ops[index][1] = False
        return [(op, transient) for op, transient in self._ops]


def log_forward(fn: Callable, args: Sequence, device_type: str = "cuda") -> list[OpRecord]:
    """:class:`OpLog` of one eager call ``fn(*args)``, taken as a region's capture will run it
    (``recorder.recording_region``: a Mamba scan slices as captured)."""
    log = OpLog(device_type)
    with torch.enable_grad(), recording_region(), log:  # what autograd saves is no transient
        out = fn(*args)
    records = log.records()  # with the output alive
    del out
    return records


class TransientRouter(TorchDispatchMode):
    """While a forward graph captures: runs the ops its log marks as transients inside ``detour()``
    (the backward pool), as long as the ops match the log; :meth:`check` after the capture.

    Args:
        log: The region's :func:`log_forward`.
        detour: A context manager factory; its block allocates in the backward pool.
        device_type: As :class:`OpLog`'s.
    """

    def __init__(
        self, log: Sequence[OpRecord], detour: Callable[[], contextlib.AbstractContextManager], device_type="cuda"
    ):
        super().__init__()
        self.log = list(log)
        self.detour = detour
        self.device_type = device_type
        self.routed = 0  # ops run inside the detour
        self.followed = 0  # ops that matched the log
        self.diverged_at: int | None = None  # the first op that differed from the log
        self._alive: dict[int, str] = {}  # routed storage data_ptr -> what made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.diverged_at is not None or not _on_device(args, kwargs, self.device_type):
            return func(*args, **kwargs)
        index = self.followed
        if index >= len(self.log) or self.log[index][0] != str(func):
            self.diverged_at = index
            return func(*args, **kwargs)
        self.followed += 1
        if not self.log[index][1]:
            return func(*args, **kwargs)
        with self.detour():
            out = func(*args, **kwargs)
        self.routed += 1
        for storage, t in made_storages((args, kwargs), out, self.device_type):
            ptr = storage.data_ptr()
            self._alive[ptr] = f"{func} -> {tuple(t.shape)} {t.dtype}"
            weakref.finalize(storage, self._alive.pop, ptr, None)
        return out

    def check(self, region: str) -> None:
        """After the capture, with its outputs held: every routed storage must be dead.

        Raises:
            RuntimeError: one is alive (the capture kept what the logged forward saw die).
        """
        if self._alive:
            raise RuntimeError(
                f"CUDA graphs: capturing {region}'s forward kept tensors alive that its logged eager forward saw die "
                f"inside it ({'; '.join(sorted(set(self._alive.values())))}), and they were allocated in the backward "
                "pool, which other graphs overwrite. Set MEGATRON_CG_FORWARD_TRANSIENTS=0 to keep forward "
                "transients in the slots' pools, and report this."
            )


def router(log: Sequence[OpRecord], capturing: GraphPool, backward_pool: GraphPool) -> TransientRouter:
    """The router of a forward captured into ``capturing``, with ``backward_pool`` for its transients."""
    return TransientRouter(log, lambda: capture_detour(capturing, backward_pool))


def _on_device(args, kwargs, device_type: str) -> bool:
    """Whether an op reads a tensor on the device or makes one there (a factory's ``device``)."""
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.device.type == device_type:
            return True
        if isinstance(x, torch.device) and x.type == device_type:
            return True
    return False


def made_storages(inputs, out, device_type: str):
    """(storage, tensor) for each storage of ``device_type`` that an op's ``out`` holds and none of
    its ``inputs`` holds: what the op allocated (not a view, not an in-place result)."""
    read = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    for t in tree_flatten(out)[0]:
        if not isinstance(t, torch.Tensor) or t.device.type != device_type:
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr in read:
            continue
        read.add(ptr)
        yield storage, t
