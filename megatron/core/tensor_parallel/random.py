"""Seeding, and the model-parallel RNG tracker for dropout inside tensor-parallel regions.

Outside the TP regions every TP rank holds the same activations, so dropout there
must draw the same mask on every rank: it uses torch's default generators, seeded
with the run's seed on every rank. Inside them (attention over this rank's heads,
and everything on a sequence shard with ``--sequence-parallel``) each rank needs its
own stream: ``RNGStatesTracker.fork()`` runs a block with the default generator
switched to a per-TP-rank state (seed + 2718 + tp_rank, Megatron's offsets). At TP = 1
nothing forks (``fork_if``), so single-rank runs draw exactly as before.

Unusual here, for CUDA graphs: on CUDA the tracked states are *generator states*
(``torch.Generator.clone_state``) swapped in with ``graphsafe_set_state``, not byte
tensors copied in and out. A captured graph that draws from one must have it
registered (``CUDAGraph.register_generator_state``): ``graph_safe_states()`` lists them
for the graph code, ``register_with_graph(graph)`` does it. Torch builds without the
graph-safe API (and CPU runs) swap byte-tensor states instead, which cannot be captured.
"""

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset of the tensor-parallel seed


def _graph_safe_api() -> bool:
    return all(hasattr(torch.Generator, name) for name in ("graphsafe_set_state", "graphsafe_get_state", "clone_state"))


class RNGStatesTracker:
    """Named random states that a block of code can draw from (``fork``).

    Args:
        device: Whose default generator is swapped: a CUDA device, or the CPU.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.graph_safe = self.device.type == "cuda" and _graph_safe_api()
        self._states: dict[str, object] = {}
        self._pending: dict[str, int] = {}  # name -> seed, made into a state on first use
        self._seeds: set[int] = set()

    def _generator(self) -> torch.Generator:
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return torch.cuda.default_generators[index]
        return torch.default_generator

    def reset(self) -> None:
        self._states.clear()
        self._pending.clear()
        self._seeds.clear()

    def is_initialized(self) -> bool:
        return bool(self._states or self._pending)

    def add(self, name: str, seed: int) -> None:
        """Adds a state seeded with ``seed``; the default generator is left as it was.

        The state is made on first use (``fork``, ``get_states``), so runs that never
        fork (TP = 1) never touch the generator API.
        """
        if name in self._states or name in self._pending:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"RNG seed {seed} is already used by another tracked state")
        self._seeds.add(seed)
        self._pending[name] = seed

    def _materialize(self) -> None:
        for name, seed in list(self._pending.items()):
            self._make_state(name, seed)
            del self._pending[name]

    def _make_state(self, name: str, seed: int) -> None:
        gen = self._generator()
        if self.graph_safe:
            original = gen.graphsafe_get_state()
            fresh = gen.clone_state()
            gen.graphsafe_set_state(fresh)
            gen.manual_seed(seed)
            gen.graphsafe_set_state(original)
            self._states[name] = fresh
        else:
            original = gen.get_state()
            gen.manual_seed(seed)
            self._states[name] = gen.get_state()
            gen.set_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Runs the block with the default generator drawing from state ``name``."""
        self._materialize()
        if name not in self._states:
            raise RuntimeError(
                f"RNG state {name!r} is not set up: call model_parallel_manual_seed(seed, tp_rank=...) first."
            )
        gen = self._generator()
        if self.graph_safe:
            original = gen.graphsafe_get_state()
            gen.graphsafe_set_state(self._states[name])
            try:
                yield
            finally:
                gen.graphsafe_set_state(original)
            return
        original = gen.get_state()
        gen.set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = gen.get_state()
            gen.set_state(original)

    def graph_safe_states(self) -> list[torch.Generator]:
        """The generator states a CUDA graph drawing inside ``fork`` must register
        (empty when the states are byte tensors, which graphs cannot track)."""
        self._materialize()
        return list(self._states.values()) if self.graph_safe else []

    def register_with_graph(self, graph) -> None:
        """Registers every tracked state with ``graph`` (a ``torch.cuda.CUDAGraph``) before capture."""
        for state in self.graph_safe_states():
            graph.register_generator_state(state)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Byte-tensor snapshot of every state (for checkpoints)."""
        self._materialize()
        out = {}
        for name, state in self._states.items():
            out[name] = state.get_state() if self.graph_safe else state.clone()
        return out

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restores a ``get_states`` snapshot (the graph-safe states are updated in place)."""
        self._materialize()
        for name, value in states.items():
            if self.graph_safe and name in self._states:
                self._states[name].set_state(value)
            elif self.graph_safe:
                raise ValueError(f"RNG state {name!r} is not tracked; seed the tracker before loading it.")
            else:
                self._states[name] = value.clone()


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's model-parallel RNG tracker (like torch's default generators, one per process)."""
    return _TRACKER


def fork_if(enabled: bool):
    """``get_rng_tracker().fork()`` when ``enabled`` (inside a TP region at TP > 1), else a no-op."""
    return _TRACKER.fork() if enabled else contextlib.nullcontext()


def model_parallel_manual_seed(seed: int, *, tp_rank: int = 0, device: torch.device | str | None = None) -> None:
    """Seeds torch's default generators with ``seed`` and the tracker with ``seed + 2718 + tp_rank``.

    Args:
        seed: The run's seed (the same on every rank, so layers initialise alike).
        tp_rank: This rank's tensor-parallel rank.
        device: Device whose generator the tracker swaps (default: CUDA when available).
    """
    global _TRACKER
    torch.manual_seed(seed)  # also seeds every CUDA device's default generator (lazily)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    _TRACKER = RNGStatesTracker(device)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
