"""The Mamba-2 state-space scan (SSD) in plain PyTorch: the chunked algorithm and a naive reference.

The recurrence, per head ``h`` (state ``S [p, n]``, ``B_t``/``C_t`` from the head's group)::

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * outer(x_t, B_t)
    y_t = S_t @ C_t + D_h * x_t

``ssd_chunked_scan`` computes it the SSD way: the sequence is cut into chunks of
``chunk_size``; inside a chunk the outputs are a masked (decaying) attention-like matrix
product, and only one state per chunk is passed along the sequence. What is unusual:

- The within-chunk decays ``exp(sum_{k=j+1..i} dt_k A)`` come from a cumulative sum
  of the masked increments (``_segsum``), not from differences of one running sum, so
  long chunks keep float32 accuracy (no cancellation between two large sums).
- Shapes are static: a sequence that is not a multiple of the chunk is zero-padded at
  the end (``dt = 0`` there, so the padding neither decays nor feeds the state) and
  trimmed afterwards. No host syncs, no data-dependent shapes: capturable.
- Low-precision inputs (bf16/fp16) are computed in float32; float64 stays float64.
  ``state_dtype`` (default: the input dtype) rounds the states that enter each chunk
  to that dtype, as the fused kernels materialize them (Megatron's
  ``--mamba-training-ssm-states-dtype``); the passing itself and the final state stay
  in the compute dtype.

``ssd_sequential_scan`` is the recurrence above, one time step at a time: the reference
the tests and ``tools/bench_mamba.py`` compare against.
"""

import functools
import weakref

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.core.transformer.cuda_graphs.recorder import in_recorded_region
from megatron.core.transformer.cuda_graphs.scratch import scratch
from megatron.core.transformer.recompute import capturing


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _decay(a: torch.Tensor) -> torch.Tensor:
    """``[..., T] -> [..., T, T]``: ``out[..., i, j] = exp(a[j+1] + ... + a[i])`` for ``i >= j``, 0 above.

    The exponent is a cumulative sum of the strictly-lower-triangular repetition of
    ``a``, so every entry is a sum of the increments it spans (no difference of two
    prefix sums); ``tril`` stands in for masks (no mask tensors to build).
    """
    t = a.shape[-1]
    sums = a.unsqueeze(-1).expand(*a.shape, t).tril(-1).cumsum(dim=-2)  # rows[..., i, j] = a[i] for i > j
    return torch.exp(sums).tril()


def _check_shapes(x, dt, A, B, C):
    b, length, h, _ = x.shape
    g = B.shape[2]
    assert dt.shape == (b, length, h), f"dt {tuple(dt.shape)} does not match x {tuple(x.shape)}"
    assert A.shape == (h,), f"A {tuple(A.shape)} needs one value per head ({h})"
    assert B.shape == C.shape and B.shape[:2] == (b, length), f"B {tuple(B.shape)} / C {tuple(C.shape)}"
    assert h % g == 0, f"{h} heads are not divisible into {g} groups"
    return g


def _skip(x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``D * x`` with ``D [h]`` or ``[h, p]`` and ``x [b, l, h, p]``."""
    return x * (D.unsqueeze(-1) if D.dim() == 1 else D)


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    state_dtype: torch.dtype | None = None,
):
    """The SSD chunked scan.

    When a gradient is wanted (and no states go in or out) it runs as
    :class:`GroupSlicedScan`: it keeps only its inputs for backward and recomputes one
    slice of groups at a time there.

    Args:
        x: ``[b, l, h, p]`` inputs per head.
        dt: ``[b, l, h]`` positive step sizes (softplus and bias already applied).
        A: ``[h]`` negative decay rates.
        B: ``[b, l, g, n]`` input projections per group (``h`` divisible by ``g``).
        C: ``[b, l, g, n]`` output projections per group.
        chunk_size: Time steps per chunk; ``l`` need not be a multiple (a shorter sequence is one chunk).
        D: ``[h]`` or ``[h, p]`` skip weights, or None.
        initial_states: ``[b, h, p, n]`` state before the first step, or None (zeros).
        return_final_states: Also return the state after the last step.
        state_dtype: Dtype the inter-chunk states are rounded to (default: ``x.dtype``).

    Returns:
        ``y [b, l, h, p]`` in ``x.dtype``; with ``return_final_states`` the tuple
        ``(y, final_states [b, h, p, n])`` (final states in the compute dtype).
    """
    _check_shapes(x, dt, A, B, C)
    assert chunk_size > 0, "chunk_size must be positive"
    tensors = (x, dt, A, B, C) if D is None else (x, dt, A, B, C, D)
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if wants_grad and initial_states is None and not return_final_states:
        return GroupSlicedScan.apply(x, dt, A, B, C, D, chunk_size, state_dtype)
    return _chunked_scan(x, dt, A, B, C, chunk_size, D, initial_states, return_final_states, state_dtype)


def _chunked_scan(x, dt, A, B, C, chunk_size, D=None, initial_states=None, return_final_states=False, state_dtype=None):
    """The scan itself, differentiable by autograd (``ssd_chunked_scan``'s arguments).

    Everything runs in one layout, heads split into ``g`` groups of ``r = h / g`` and the
    sequence into ``c`` chunks of ``q``: ``x [b, g, r, c, q, p]``, ``B``/``C [b, g, c, q, n]``,
    so that each step is one batched matmul or one elementwise op (few kernels: in eager
    mode the host launching them is what the scan's time is).
    """
    g = B.shape[2]
    length = x.shape[1]
    out_dtype = x.dtype
    cdt = _compute_dtype(x.dtype)
    state_dtype = out_dtype if state_dtype is None else state_dtype
    q = min(int(chunk_size), length)  # a sequence shorter than a chunk is one chunk, unpadded
    pad = (-length) % q
    per_position_A = A.dim() == 3  # [b, l, h] (GroupSlicedScan's backward) instead of [h]
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
        A = F.pad(A, (0, 0, 0, pad)) if per_position_A else A

    def laid_out(t, pattern, **sizes):  # one copy: to the compute dtype and contiguous in the layout above
        return rearrange(t, pattern, q=q, **sizes).to(cdt, memory_format=torch.contiguous_format)

    xs = laid_out(x, "b (c q) (g r) p -> b g r c q p", g=g)
    dts = laid_out(dt, "b (c q) (g r) -> b g r c q", g=g)
    Bs = laid_out(B, "b (c q) g n -> b g c q n")
    Cs = laid_out(C, "b (c q) g n -> b g c q n")
    As = laid_out(A, "b (c q) (g r) -> b g r c q", g=g) if per_position_A else A.to(cdt).view(g, -1, 1, 1)
    a = dts * As  # [b, g, r, c, q] (<= 0)
    xdt = xs * dts.unsqueeze(-1)

    # 1. Within each chunk: y_i += sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j.
    decay = _decay(a)  # [b, g, r, c, q(i), q(j)]
    cb = Cs @ Bs.transpose(-1, -2)  # [b, g, c, i, j], shared by the heads of a group
    y = (cb.unsqueeze(2) * decay) @ xdt  # [b, g, r, c, q, p]

    # 2. The state each chunk produces on its own: sum_j exp(a_{j+1} + ... + a_last) dt_j x_j B_j^T.
    to_end = decay[..., -1, :].unsqueeze(-1)  # [b, g, r, c, q, 1]: the last row of the decay matrix
    states = (xdt * to_end).transpose(-1, -2) @ Bs.unsqueeze(2)  # [b, g, r, c, p, n]

    # 3. Pass states along the chunks: S_c = exp(sum of chunk c's a) S_{c-1} + states_c.
    if initial_states is None:
        first = torch.zeros_like(states[:, :, :, :1])
    else:
        first = rearrange(initial_states.to(cdt), "b (g r) p n -> b g r 1 p n", g=g)
    states = torch.cat([first, states], dim=3)  # [b, g, r, c + 1, p, n]
    chunk_decay = _decay(F.pad(a.sum(dim=-1), (1, 0)))  # [b, g, r, c + 1, c + 1]
    passed = (chunk_decay @ states.flatten(-2)).unflatten(-1, states.shape[-2:])
    entering, final = passed[:, :, :, :-1], passed[:, :, :, -1]  # state entering each chunk; after the last
    if state_dtype != cdt:  # the materialized inter-chunk states (the passing itself runs in cdt)
        entering = entering.to(state_dtype).to(cdt)

    # 4. What the entering state contributes inside each chunk: C_i . (exp(a_0 + ... + a_i) S).
    from_start = torch.exp(a.cumsum(dim=-1)).unsqueeze(-1)  # [b, g, r, c, q, 1]
    y = y + from_start * (Cs.unsqueeze(2) @ entering.transpose(-1, -2))
    if D is not None:  # D [h] or [h, p]
        y = y + xs * D.to(cdt).view(g, -1, 1, 1, 1 if D.dim() == 1 else D.shape[-1])

    y = rearrange(y, "b g r c q p -> b (c q) (g r) p")[:, :length].to(out_dtype)
    if return_final_states:
        return y, rearrange(final, "b g r p n -> b (g r) p n")
    return y


SLICE_BYTES = 32 * 2**20
"""Budget of one ``[batch, heads, chunks, chunk, chunk]`` decay matrix in :class:`GroupSlicedScan`'s
backward while a CUDA graph captures it: as many groups go into one slice as fit (at least one). A
graph keeps its transients reserved in the graph pool, so its slices are smaller than eager ones;
replaying costs no host time per slice, but small slices keep the GPU less busy. The budget is the
smallest that keeps a graphed step about as fast as an eager one (the README's hybrid measurements).
The recording iteration runs a region it captures next at this budget too: it is an eager iteration,
and its peak counts as the graphed run's. An eager scan inside an eager turn keeps the eager budget,
though its transients then stay reserved in the backward pool: this budget there doubles the eager
scan's kernel launches, which set its time (the README's hybrid measurements)."""
EAGER_SLICE_BYTES = 256 * 2**20
"""The same budget when the scan runs eagerly. The host launches some 250 kernels per slice, and
eagerly that launching is the scan's time, while the transient of one layer's backward comes and
goes in the caching allocator like any other: so eager slices are large. Slicing changes no bit of
the result (groups are independent, and backward takes the per-head sums over the sequence whole),
so graphed and eager steps stay equal."""
FORWARD_SLICES = 2
"""Forward, which holds about a third of the matrices backward does (no autograd), fits this many
times the budget."""


def _slice_budget() -> int:
    """A captured scan's budget, also where the recording iteration runs a region it captures next
    (its eager peak counts as the graphed run's); an eager scan's elsewhere."""
    return SLICE_BYTES if capturing() or in_recorded_region() else EAGER_SLICE_BYTES


def _group_slices(x: torch.Tensor, B: torch.Tensor, chunk_size: int, budget: int) -> list[tuple[slice, slice]]:
    """``(heads, groups)`` index slices of whole groups, each slice's decay matrix within ``budget`` bytes."""
    b, length, h, _ = x.shape
    g = B.shape[2]
    q = min(int(chunk_size), length)
    chunks = -(-length // q)
    per_group = b * (h // g) * chunks * q * q * torch.empty((), dtype=_compute_dtype(x.dtype)).element_size()
    step = max(1, min(g, budget // per_group))
    r = h // g
    return [(slice(k * r, min(k + step, g) * r), slice(k, min(k + step, g))) for k in range(0, g, step)]


class GroupSlicedScan(torch.autograd.Function):
    """``_chunked_scan`` that saves only its inputs and works on a few groups at a time.

    Groups are independent (a head reads its own ``x``, ``dt``, ``A``, ``D`` and its
    group's ``B``, ``C``), so the output is computed slice by slice of whole groups, and
    backward recomputes each slice under autograd and takes its gradients before the next.
    The plain scan keeps about 20 float32 copies of ``x``'s size for backward (the decay
    matrices above all); this keeps the inputs, and its transient memory is one slice's.
    Same shapes on every call and no host syncs: capturable in a CUDA graph.
    """

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, chunk_size, state_dtype):
        ctx.chunk_size, ctx.state_dtype = chunk_size, state_dtype
        ctx.budget = _slice_budget()  # backward slices as forward chose (it may run elsewhere: autograd's thread)
        ctx.save_for_backward(x, dt, A, B, C, D)
        y = torch.empty_like(x)
        for heads, groups in _group_slices(x, B, chunk_size, FORWARD_SLICES * ctx.budget):
            pieces = _slice((x, dt, A, B, C, D), heads, groups)
            with scratch():  # the slice's working memory dies here; its result goes into y
                y[:, :, heads] = _chunked_scan(*pieces[:5], chunk_size, D=pieces[5], state_dtype=state_dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        grads = _sliced_backward(
            ctx.saved_tensors, ctx.needs_input_grad[:6], dy, ctx.chunk_size, ctx.state_dtype, ctx.budget
        )
        return (*grads, None, None)


def _sliced_backward(saved, needs, dy, chunk_size, state_dtype, budget=None) -> tuple:
    """:class:`GroupSlicedScan`'s backward: the gradients of ``x, dt, A, B, C, D`` (None where not
    needed), slices of ``budget`` bytes (default: the capture or eager one)."""
    x, dt, A, B, C, D = saved
    need_x, need_dt, need_A, need_B, need_C, need_D = needs
    b, length, h = dt.shape
    # A's and D's gradients are sums over the whole sequence per head. Summed inside each
    # slice, their order would follow the slicing, which differs between a captured and an
    # eager step; so A goes in per position (its gradient is then elementwise) and D not at
    # all, and both are summed whole below, in one order whatever the slicing.
    inputs = (x, dt, A.expand(b, length, h), B, C, D)
    wanted = (need_x, need_dt, need_A, need_B, need_C, False)
    # The slices cover every head and group once, so each gradient is written whole.
    grads = [torch.empty_like(t) if need else None for t, need in zip(inputs, wanted)]
    for heads, groups in _group_slices(x, B, chunk_size, _slice_budget() if budget is None else budget):
        pieces = _slice(inputs, heads, groups)
        leaves = [p.detach().requires_grad_(need) if p is not None else None for p, need in zip(pieces, wanted)]
        with torch.enable_grad():
            y = _chunked_scan(*leaves[:5], chunk_size, D=leaves[5], state_dtype=state_dtype)
        differentiable = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        found = iter(torch.autograd.grad(y, differentiable, dy[:, :, heads]))
        for part, leaf in zip(_slice(grads, heads, groups), leaves):
            if leaf is not None and leaf.requires_grad:
                part.copy_(next(found))
        del y, found, leaves
    dA = grads[2].sum(dim=(0, 1)) if need_A else None
    dD = None
    if need_D:  # y = ... + D x: dD sums dy x over the sequence (and the head dim for D [h])
        cdt = _compute_dtype(x.dtype)
        dD = (dy.to(cdt) * x.to(cdt)).sum(dim=(0, 1) if D.dim() == 2 else (0, 1, 3)).to(D.dtype)
    return grads[0], grads[1], dA, grads[3], grads[4], dD


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that operations create, while they live, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage._cdata, storage.nbytes()
            if key in self._seen or size == 0:
                continue
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)


def captured_backward_peak_bytes(
    batch: int, length: int, heads: int, head_dim: int, groups: int, state: int, chunk_size: int, dtype: torch.dtype
) -> int:
    """Peak bytes :class:`GroupSlicedScan`'s backward allocates while a CUDA graph captures it
    (slices of ``SLICE_BYTES``): its gradients and one slice's recompute and autograd.

    Found by running that backward on the meta device (shapes only, no data, no device)
    and counting what each operation creates while it lives: exact for this scan's
    operations, however they change. ``x``, ``B``, ``C`` in ``dtype``, ``dt``, ``A``, ``D``
    in float32, as the mixer passes them. Every Mamba layer of a model asks the same
    question, so each answer is traced once.
    """
    return _traced_backward_peak(batch, length, heads, head_dim, groups, state, chunk_size, dtype, SLICE_BYTES)


@functools.lru_cache(maxsize=64)
def _traced_backward_peak(batch, length, heads, head_dim, groups, state, chunk_size, dtype, budget) -> int:
    meta = dict(device="meta")
    f32 = dict(dtype=torch.float32, **meta)
    saved = (
        torch.empty(batch, length, heads, head_dim, dtype=dtype, **meta),
        torch.empty(batch, length, heads, **f32),
        torch.empty(heads, **f32),
        torch.empty(batch, length, groups, state, dtype=dtype, **meta),
        torch.empty(batch, length, groups, state, dtype=dtype, **meta),
        torch.empty(heads, **f32),
    )
    dy = torch.empty_like(saved[0])
    counter = _LiveBytes()
    with counter:
        _sliced_backward(saved, (True,) * 6, dy, chunk_size, None, budget=budget)
    return counter.peak


def _slice(tensors, heads: slice, groups: slice) -> tuple:
    """Views of one slice of whole groups of ``x, dt, A, B, C, D`` (or of their gradients; None stays None)."""
    index = (
        (slice(None), slice(None), heads),  # x [b, l, h, p]
        (slice(None), slice(None), heads),  # dt [b, l, h]
        (..., heads),  # A [h] or [b, l, h]
        (slice(None), slice(None), groups),  # B [b, l, g, n]
        (slice(None), slice(None), groups),  # C
        (heads,),  # D [h] or [h, p]
    )
    return tuple(None if t is None else t[i] for t, i in zip(tensors, index))


def ssd_sequential_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
):
    """The recurrence one step at a time (reference; same arguments as ``ssd_chunked_scan``)."""
    g = _check_shapes(x, dt, A, B, C)
    b, length, h, p = x.shape
    n = B.shape[-1]
    cdt = _compute_dtype(x.dtype)
    x_, dt_, A_ = x.to(cdt), dt.to(cdt), A.to(cdt)
    # Each head reads its group's B and C.
    B_ = B.to(cdt).repeat_interleave(h // g, dim=2)  # [b, l, h, n]
    C_ = C.to(cdt).repeat_interleave(h // g, dim=2)
    if initial_states is None:
        state = torch.zeros(b, h, p, n, dtype=cdt, device=x.device)
    else:
        state = initial_states.to(cdt)
    ys = []
    for t in range(length):
        step_decay = torch.exp(dt_[:, t] * A_)  # [b, h]
        update = (dt_[:, t, :, None] * x_[:, t]).unsqueeze(-1) * B_[:, t].unsqueeze(-2)  # [b, h, p, n]
        state = state * step_decay[:, :, None, None] + update
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C_[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + _skip(x_, D.to(cdt))
    y = y.to(x.dtype)
    if return_final_states:
        return y, state
    return y
