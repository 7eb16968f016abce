"""Why a dropped training run is still alive: the objects that hold it from outside Python's view.

A trainer dropped without ``close()`` should free its model, graph session and graph pools once
the cycle collector runs. When something survives, the collector saw a reference it could not
explain: one held from C++ (an autograd hook, a C++ node keeping a Python callback), from a
running frame, or from a module global. This tool walks the referrers of a surviving object
upward (``gc.get_referrers``) and reports every ancestor whose reference count exceeds the
references its gc-visible referrers account for, and every module global on the way, each with
the chain of referrers that leads down to the object. An autograd node held from C++ (a custom
Function's context, say) comes with the live tensors whose autograd graph reaches it: a graph
whose backward never runs keeps its nodes, and a node's context may hold the run.

Usage (on a GPU; ``--vpp-rank`` runs two chunks in rank R's interleaved order, as
``pool_peak.py`` does):
    python tools/holders.py --config dense8 --mode local:layer --vpp-rank 1 \\
        --extra="--global-batch-size 8 --untie-embeddings-and-output-weights --deterministic-mode"

It prints the bytes still allocated after the drop, whether the graph session, the model and
any graph pool survived, and for a surviving session the holders found. Without CUDA the run is
eager (graphs off), which checks only that an eager trainer is freed.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Holder:
    """An ancestor of the object asked about that something outside gc's view holds."""

    kind: str  # "external" (unexplained references) or "module global"
    description: str
    chain: str  # the referrers from it down to the object asked about
    unexplained: int  # references no gc-visible referrer accounts for
    graph_of: list[str] = dataclasses.field(default_factory=list)  # an autograd node's: see tensors_reaching


def describe(obj, child=None) -> str:
    """A short name for ``obj``; for a dict, the keys under which it holds ``child``."""
    if isinstance(obj, dict):
        keys = [k for k, v in obj.items() if v is child][:3]
        return f"dict{keys!r}"[:120]
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        return f"function {obj.__qualname__} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    if isinstance(obj, types.MethodType):
        return f"method {obj.__func__.__qualname__}"
    if isinstance(obj, (list, tuple, set)):
        return f"{type(obj).__name__} of {len(obj)}"
    return type(obj).__qualname__


def _references(obj) -> tuple[int, int]:
    """``(reference count, references that gc-visible referrers account for)`` of ``obj``."""
    explained = sum(sum(1 for x in gc.get_referents(r) if x is obj) for r in gc.get_referrers(obj))
    return sys.getrefcount(obj), explained


def external_holders(target, limit: int = 1000) -> list[Holder]:
    """The ancestors of ``target`` held from outside the cycle collector's view.

    Walks ``gc.get_referrers`` upward from ``target`` (breadth first, at most ``limit`` objects;
    each step scans every object the collector tracks, so keep it small), skipping frames and this
    search's own containers. Module dicts end a chain and are reported as module globals; every
    other ancestor is checked for references its referrers do not explain. Strings, numbers and
    types are never reported (interned, cached, or referenced by their own method caches).
    """
    found: dict[int, object] = {id(target): target}
    chains: dict[int, str] = {id(target): describe(target)}
    queue = [id(target)]
    holders: list[Holder] = []
    at = 0
    while at < len(queue) and len(queue) < limit:
        obj = found[queue[at]]
        at += 1
        for ref in gc.get_referrers(obj):
            if ref is found or ref is queue or isinstance(ref, types.FrameType) or id(ref) in found:
                continue
            if isinstance(ref, dict) and "__builtins__" in ref:  # a module's globals
                holders.append(
                    Holder("module global", f"{ref.get('__name__')}.{describe(ref, obj)}", chains[id(obj)], 0)
                )
                continue
            found[id(ref)] = ref
            chains[id(ref)] = f"{describe(ref, obj)} -> {chains[id(obj)]}"
            queue.append(id(ref))
        del obj
    # What this search's own locals and calls add to a reference count, measured on a probe that
    # only the search's dict holds (it differs between Python versions).
    probe = object()
    found[id(probe)] = probe
    count, explained = _references(probe)
    ours = count - explained
    del found[id(probe)], probe
    for key in queue:
        obj = found[key]
        if key != id(target) and not isinstance(obj, (str, bytes, int, float, type)):  # the caller holds target
            count, explained = _references(obj)
            if count - explained > ours:
                holder = Holder("external", describe(obj), chains[key], count - explained - ours)
                if hasattr(obj, "next_functions"):  # an autograd node: held by the graph of a live tensor?
                    holder.graph_of = tensors_reaching(obj, skip=(found, queue))
                holders.append(holder)
        del obj
    return holders


def tensors_reaching(node, skip: tuple = (), limit: int = 20000) -> list[str]:
    """The live tensors whose autograd graph reaches ``node`` (an autograd node, such as a custom
    Function's context), each with a chain of referrers above it: what holds a node from C++. A
    node lives while a tensor's ``grad_fn`` or a later node leads to it; a graph whose backward
    never ran stays whole. ``skip``: containers of the caller's search, left out of the chains."""
    import torch

    found = []
    objects = gc.get_objects()
    for obj in objects:
        if not issubclass(type(obj), torch.Tensor) or obj.grad_fn is None:  # type(): no module __getattr__
            continue
        seen, stack = set(), [obj.grad_fn]
        while stack and len(seen) < limit:
            fn = stack.pop()
            if fn is node:
                found.append(
                    f"tensor {tuple(obj.shape)} {obj.dtype} with grad_fn {type(obj.grad_fn).__name__}"
                    f" <- {_upward(obj, {id(objects), id(stack), *map(id, skip)})}"
                )
                break
            if id(fn) not in seen:
                seen.add(id(fn))
                stack += [f for f, _ in fn.next_functions if f is not None]
        del fn, stack
    return found


def _upward(obj, skip: set[int], depth: int = 6) -> str:
    """One chain of gc-visible referrers above ``obj`` (the first at each level), ``skip`` aside."""
    path, skip = [], set(skip)
    for _ in range(depth):
        refs = [r for r in gc.get_referrers(obj) if not isinstance(r, types.FrameType) and id(r) not in skip]
        if not refs:
            break
        path.append(describe(refs[0], obj))
        obj = refs[0]
        skip.add(id(obj))
        del refs  # else the next level finds this list among obj's referrers
    return " <- ".join(path) or "no gc-visible referrer"


def main(argv: list[str] | None = None):
    import argparse
    import weakref

    import torch

    import pretrain_hybrid
    from megatron.core import parallel_state
    from megatron.core.transformer.cuda_graphs.pool import use_expandable_segments
    from megatron.training.data import build_data_iterators
    from megatron.training.training import build_trainer
    from tools.graph_bench import COMMON, CONFIGS, mode_flags
    from tools.pool_peak import with_schedule

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="dense8")
    parser.add_argument("--mode", default="local:layer", help="a mode of graph_bench.py")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--vpp-rank", type=int, choices=(0, 1), help="two chunks in rank R's interleaved order")
    parser.add_argument("--extra", default="", help="more training flags (the = form)")
    parser.add_argument("--top", type=int, default=12, help="holders to print")
    args = parser.parse_args(argv)

    use_expandable_segments()
    flags = f"{CONFIGS[args.config]} {COMMON} --train-iters {args.iters} {mode_flags(args.mode)} {args.extra}".split()

    def run():
        trainer = with_schedule(build_trainer(flags, **pretrain_hybrid.providers(flags)), args.vpp_rank)
        try:
            it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
            trainer.model.train()
            for _ in range(args.iters):
                trainer.train_step(it)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return weakref.ref(trainer.graphs), weakref.ref(trainer.model)
        finally:
            parallel_state.destroy(trainer.pg)

    cuda = torch.cuda.is_available()
    if not cuda:
        print("no CUDA: graphs are off (no session records or captures); this checks the eager run only")
    pools_before = _private_pools() if cuda else set()
    session_ref, model_ref = run()
    gc.collect()
    memory = ""
    if cuda:
        torch.cuda.empty_cache()
        memory = (
            f"{torch.cuda.memory_allocated() / 2**20:.0f} MiB allocated, "
            f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB reserved, "
            f"graph pools left: {len(_private_pools() - pools_before)}; "
        )
    print(f"after the drop: {memory}session alive: {session_ref() is not None}, model alive: {model_ref() is not None}")
    target = session_ref() if session_ref() is not None else model_ref()
    if target is None:
        return
    holders = external_holders(target)
    print(f"{len(holders)} holders of the surviving {describe(target)}:")
    alike: dict[tuple, list[Holder]] = {}  # the same kind of holder over the same chain, counted once
    for h in holders:
        alike.setdefault((h.kind, h.description, h.chain), []).append(h)
    for (kind, description, chain), group in list(alike.items())[: args.top]:
        print(f"  {len(group)} x {kind} (+{group[0].unexplained}): {description}\n      {chain[:600]}")
        graph_of = sorted({t for h in group for t in h.graph_of})
        for t in graph_of[:4]:
            print(f"      in the autograd graph of {t[:400]}")
        if len(graph_of) > 4:
            print(f"      ... and {len(graph_of) - 4} more tensors")


def _private_pools() -> set:
    import torch

    return {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()} - {(0, 0)}


if __name__ == "__main__":
    main()
