"""tools/holders.py: the ancestors of a surviving object that something outside gc's view holds."""

import gc
import weakref

import pytest
import torch

from tools.holders import external_holders


class Owner:
    pass


def _owner_in_a_hook_cycle() -> Owner:
    """An owner whose output tensor's autograd node keeps a hook that holds the owner: C++ holds the
    hook, so the collector cannot free the cycle (the kind of leak e87194f fixed)."""
    owner = Owner()
    owner.y = torch.zeros(2, requires_grad=True) * 2
    owner.handle = torch.autograd.graph.register_multi_grad_hook((owner.y,), lambda grads: owner)
    return owner


def test_a_hook_held_from_cpp_is_named_with_its_chain_down_to_the_owner():
    ref = weakref.ref(_owner_in_a_hook_cycle())
    gc.collect()
    assert ref() is not None, "the cycle through autograd's C++ side survives the collector"
    holders = external_holders(ref())
    external = [h for h in holders if h.kind == "external"]
    assert len(external) == 1 and external[0].unexplained >= 1, holders
    chain = external[0].chain
    assert "_owner_in_a_hook_cycle.<locals>.<lambda>" in chain, chain  # torch's wrappers above it vary
    assert chain.endswith("Owner")
    ref().handle.remove()  # breaks the cycle: now the collector frees it
    gc.collect()
    assert ref() is None


def test_an_object_held_only_by_python_has_no_external_holder_and_a_global_is_named():
    owner = Owner()
    owner.parts = {"a": [owner], "b": (owner, 1)}  # cycles the collector sees
    assert [h for h in external_holders(owner) if h.kind == "external"] == []
    global KEPT
    KEPT = [owner]
    try:
        holders = external_holders(owner)
        assert [(h.kind, h.description) for h in holders] == [("module global", f"{__name__}.dict['KEPT']")]
        assert holders[0].chain == "list of 1 -> Owner"
    finally:
        del KEPT


class _Held(torch.autograd.Function):
    """A custom Function whose context holds an owner, as a graph replay's holds its session."""

    @staticmethod
    def forward(ctx, owner, x):
        ctx.owner = owner
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return None, grad * 2


def _owner_whose_buffer_took_a_graph() -> Owner:
    """An owner's buffer written by an autograd copy from a tensor whose graph holds the owner: the
    buffer's ``grad_fn`` leads to the Function's context, which C++ holds (the simulated receive's
    leak on the GPU)."""
    owner = Owner()
    owner.buffer = torch.zeros(3)
    owner.buffer.copy_(_Held.apply(owner, torch.ones(3, requires_grad=True)))
    return owner


def test_an_autograd_node_held_from_cpp_names_the_tensor_whose_graph_reaches_it():
    ref = weakref.ref(_owner_whose_buffer_took_a_graph())
    gc.collect()
    assert ref() is not None, "the buffer's graph keeps the owner alive"
    external = [h for h in external_holders(ref()) if h.kind == "external"]
    assert [h.description for h in external] == ["_HeldBackward"], external
    (reaching,) = external[0].graph_of
    assert reaching.startswith("tensor (3,) torch.float32 with grad_fn CopyBackwards <- Owner"), reaching
    ref().buffer = None  # drops the graph: now the collector frees the owner
    gc.collect()
    assert ref() is None


@pytest.mark.filterwarnings("ignore:--cuda-graph-impl local. CUDA is not available:UserWarning")
def test_the_command_line_drops_a_trainer_of_interleaved_chunks_and_finds_it_freed(capsys):
    """On the CPU graphs are off: the command line builds, trains and drops an eager trainer of rank
    1's two-chunk order and reports it freed (on a GPU the same run is graphed)."""
    from tools.holders import main

    main(
        [
            "--config",
            "small",
            "--mode",
            "local:layer",
            "--vpp-rank",
            "1",
            "--iters",
            "2",
            "--extra=--global-batch-size 8",
        ]
    )
    out = capsys.readouterr().out
    assert "session alive: False, model alive: False" in out, out
