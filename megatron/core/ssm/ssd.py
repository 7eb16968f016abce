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

import os

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.autograd.function import once_differentiable

from megatron.core.ssm import ssd_kernels
from megatron.core.transformer.cuda_graphs.recorder import in_recorded_region
from megatron.core.transformer.cuda_graphs.scratch import scratch, scratch_routes
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
    rows = a.unsqueeze(-1).expand(*a.shape, t).tril(-1)  # rows[..., i, j] = a[i] for i > j
    if torch.is_grad_enabled() and a.requires_grad:  # autograd saves exp's output: no in-place steps
        return torch.exp(rows.cumsum(dim=-2)).tril()
    return rows.cumsum_(dim=-2).exp_().tril_()  # one matrix instead of three


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
    slice of groups at a time there. Without states in or out, on CUDA, the Triton kernels of
    ``ssd_kernels`` compute it unless ``MEGATRON_SSD_KERNELS=torch``.

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
    if initial_states is None and not return_final_states:
        if wants_grad:
            return GroupSlicedScan.apply(x, dt, A, B, C, D, chunk_size, state_dtype)
        if ssd_kernels.available(x):  # evaluation: the kernels of the training forward
            return ssd_kernels.scan(x, dt, A, B, C, chunk_size, D=D, state_dtype=state_dtype)
    return _chunked_scan(x, dt, A, B, C, chunk_size, D, initial_states, return_final_states, state_dtype)


_LAYOUT = (
    "b (c q) (g r) p -> b g r c q p",  # x (and y, dy)
    "b (c q) (g r) -> b g r c q",  # dt (and a per-position A)
    "b (c q) g n -> b g c q n",  # B
    "b (c q) g n -> b g c q n",  # C
)


def _laid_out(tensors, q: int, g: int, cdt: torch.dtype) -> list:
    """``x, dt, B, C`` (None stays None) in the scan's layout: one copy each, in the compute dtype, contiguous
    (a copy also where the dtype is already the compute dtype: the scan may write over it)."""
    return [
        None if t is None else rearrange(t, pattern, q=q, g=g).to(cdt, memory_format=torch.contiguous_format, copy=True)
        for t, pattern in zip(tensors, _LAYOUT)
    ]


def _times(t: torch.Tensor, factor: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``t * factor``, written over ``t`` where ``in_place`` (no autograd records ``t``, nothing else reads it)."""
    return t.mul_(factor) if in_place else t * factor


def _chunk_states(weighted: torch.Tensor, Bs: torch.Tensor) -> torch.Tensor:
    """``[b, g, r, c, p, n]``: the state each chunk makes on its own, ``sum_j to_end_j xdt_j B_j^T``,
    from ``weighted = xdt * to_end`` (``to_end [b, g, r, c, q]``: each position's decay to its chunk's end)."""
    return torch.einsum("bgrcqp,bgcqn->bgrcpn", weighted, Bs)


def _skip_weights(D: torch.Tensor, g: int, cdt: torch.dtype) -> torch.Tensor:
    """``D [h]`` or ``[h, p]`` in the compute dtype, shaped to multiply ``[b, g, r, c, q, p]``."""
    return D.to(cdt).view(g, -1, 1, 1, 1 if D.dim() == 1 else D.shape[-1])


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

    # Without autograd (GroupSlicedScan's forward) the steps below scale their intermediates in place
    # and drop each once used: the transient then holds one [b, g, r, c, q, q] matrix at a time.
    lean = not torch.is_grad_enabled()
    xs, dts, Bs, Cs = _laid_out((x, dt, B, C), q, g, cdt)
    As = _laid_out((None, A), q, g, cdt)[1] if per_position_A else A.to(cdt).view(g, -1, 1, 1)
    a = dts * As  # [b, g, r, c, q] (<= 0)
    # D's term reads x again: lean, as laid out in place (xs becomes x dt); under autograd, the copy,
    # so that x's gradient is summed in the compute dtype before its one rounding.
    skip_x = rearrange(x, _LAYOUT[0], q=q, g=g) if lean else xs
    xdt = _times(xs, dts.unsqueeze(-1), lean)
    del xs

    # 1. Within each chunk: y_i += sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j.
    decay = _decay(a)  # [b, g, r, c, q(i), q(j)]
    cb = Cs @ Bs.transpose(-1, -2)  # [b, g, c, i, j], shared by the heads of a group
    to_end = decay[..., -1, :].clone()  # [b, g, r, c, q]: the last row of the decay matrix
    y = _times(decay, cb.unsqueeze(2), lean) @ xdt  # [b, g, r, c, q, p]
    del decay, cb

    # 2. The state each chunk produces on its own: sum_j exp(a_{j+1} + ... + a_last) dt_j x_j B_j^T.
    states = _chunk_states(_times(xdt, to_end.unsqueeze(-1), lean), Bs)  # [b, g, r, c, p, n]
    del xdt, to_end

    # 3. Pass states along the chunks: S_c = exp(sum of chunk c's a) S_{c-1} + states_c.
    if initial_states is None:
        first = torch.zeros_like(states[:, :, :, :1])
    else:
        first = rearrange(initial_states.to(cdt), "b (g r) p n -> b g r 1 p n", g=g)
    states = torch.cat([first, states], dim=3)  # [b, g, r, c + 1, p, n]
    chunk_decay = _decay(F.pad(a.sum(dim=-1), (1, 0)))  # [b, g, r, c + 1, c + 1]
    passed = (chunk_decay @ states.flatten(-2)).unflatten(-1, states.shape[-2:])
    del states
    entering, final = passed[:, :, :, :-1], passed[:, :, :, -1]  # state entering each chunk; after the last
    if state_dtype != cdt:  # the materialized inter-chunk states (the passing itself runs in cdt)
        entering = entering.to(state_dtype).to(cdt)
    if not return_final_states:
        del passed, final

    # 4. What the entering state contributes inside each chunk: C_i . (exp(a_0 + ... + a_i) S).
    from_start = torch.exp(a.cumsum(dim=-1)).unsqueeze(-1)  # [b, g, r, c, q, 1]
    y += _times(torch.einsum("bgcqn,bgrcpn->bgrcqp", Cs, entering), from_start, lean)  # y is no saved tensor
    del entering
    if D is not None:  # D [h] or [h, p]
        y += skip_x * _skip_weights(D, g, cdt)
    del skip_x

    y = rearrange(y, "b g r c q p -> b (c q) (g r) p")[:, :length].to(out_dtype)
    if return_final_states:
        return y, rearrange(final, "b g r p n -> b (g r) p n")
    return y


def _exponent_grad(ds: torch.Tensor) -> torch.Tensor:
    """The gradient of ``a`` through ``_decay(a)``, from ``ds = d(decay) * decay`` ``[..., T, T]``:
    ``da_k = sum_{j < k} sum_{i >= k} ds[i, j]``, since ``decay[i, j]``'s exponent sums ``a[j+1..i]``.

    The sum over ``i`` is a scan down the rows and the one over ``j`` a reduction along them, as
    autograd takes it: a reduction across rows would be split differently for another number of
    rows (another slice of groups), and slicing must not change a bit.
    """
    t = ds.shape[-1]
    up = ds.flip(-2).cumsum_(dim=-2)  # up[T-1-k, j] = sum_{i >= k} ds[i, j]
    below = torch.ones(t, t, dtype=ds.dtype, device=ds.device).tril_(-1).flip(0)  # (T-1-k, j) with j < k
    return up.mul_(below).sum(dim=-1).flip(-1)


def _chunked_scan_grads(x, dt, A, B, C, D, chunk_size, state_dtype, dy) -> tuple:
    """The gradients of ``_chunked_scan(x, dt, A, B, C, chunk_size, D, state_dtype=state_dtype)``
    (no initial or final states) with respect to ``x, dt, A, B, C``, given ``dy``, worked out by hand.

    ``A`` is per position (``[b, l, h]``), and so is its gradient. Autograd through the scan keeps
    every intermediate of the recompute at once, some twelve ``[b, h, c, q, q]`` matrices; here
    at most two live at a time, each dropped as soon as its part is done (the within-chunk term
    first, then the chunk states). Returns the five gradients in the compute dtype, in the
    inputs' shapes.
    """
    g = B.shape[2]
    length = x.shape[1]
    cdt = _compute_dtype(x.dtype)
    state_dtype = x.dtype if state_dtype is None else state_dtype
    q = min(int(chunk_size), length)
    pad = (-length) % q
    if pad:
        x, B, C, dy = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C, dy))
        dt, A = (F.pad(t, (0, 0, 0, pad)) for t in (dt, A))
    xdt, dts, Bs, Cs = _laid_out((x, dt, B, C), q, g, cdt)
    As = _laid_out((None, A), q, g, cdt)[1]
    dY = _laid_out((dy,), q, g, cdt)[0]  # for the matmuls; elementwise steps read dy as laid out, in place
    a = dts * As  # [b, g, r, c, q]
    xdt.mul_(dts.unsqueeze(-1))  # x dt [b, g, r, c, q, p]; x is laid out again at the end

    # 1. Within each chunk: y += (cb * decay) @ xdt, cb = C B^T shared by a group's heads.
    decay = _decay(a)  # [b, g, r, c, q(i), q(j)]
    cb = (Cs @ Bs.transpose(-1, -2)).unsqueeze(2)  # [b, g, 1, c, i, j]
    ddecay = (dY @ xdt.transpose(-1, -2)).mul_(decay)  # d(cb * decay) * decay
    to_end = decay[..., -1, :].clone()  # [b, g, r, c, q]: each position's decay to its chunk's end
    dxdt = decay.mul_(cb).transpose(-1, -2) @ dY
    del decay
    dcb = ddecay.sum(dim=2)  # [b, g, c, i, j]
    da = _exponent_grad(ddecay.mul_(cb))
    del ddecay, cb
    dB = dcb.transpose(-1, -2) @ Cs
    dC = dcb @ Bs
    del dcb

    # 2. The state each chunk makes on its own (sum_j to_end_j xdt_j B_j^T), passed along the chunks
    # (S_c = exp(sum of chunk c's a) S_{c-1} + states_c) to the state entering each chunk.
    def own_states(xdt):  # [b, g, r, c + 1, p n], a zero state first; made twice rather than kept through step 3
        return F.pad(_chunk_states(xdt * to_end.unsqueeze(-1), Bs).flatten(-2), (0, 0, 1, 0))

    chunk_decay = _decay(F.pad(a.sum(dim=-1), (1, 0)))  # [b, g, r, c + 1, c + 1]
    entering = (chunk_decay[..., :-1, :] @ own_states(xdt)).unflatten(
        -1, (x.shape[-1], B.shape[-1])
    )  # [b, g, r, c, p, n]
    if state_dtype != cdt:
        entering.copy_(entering.to(state_dtype))

    # 3. What the entering state adds inside each chunk: exp(a_0 + ... + a_i) C_i . S.
    del dY
    dY = rearrange(dy, _LAYOUT[0], q=q, g=g)  # [b, g, r, c, q, p], not copied: products with it are float32
    from_start = torch.exp(a.cumsum(dim=-1))  # [b, g, r, c, q]
    dcum = (dY * torch.einsum("bgcqn,bgrcpn->bgrcqp", Cs, entering)).sum(dim=-1).mul_(from_start)
    da += dcum.flip(-1).cumsum(dim=-1).flip(-1)  # through the cumsum: sum over i >= k
    del dcum
    dfrom = dY * from_start.unsqueeze(-1)
    dC += torch.einsum("bgrcqp,bgrcpn->bgcqn", dfrom, entering)
    dentering = torch.einsum("bgrcqp,bgcqn->bgrcpn", dfrom, Cs)
    del dfrom, entering
    if state_dtype != cdt:  # the rounding's gradient is rounded too, as autograd's casts do
        dentering.copy_(dentering.to(state_dtype))

    # 4. Back through the passing and the chunks' own states.
    dpassed = F.pad(dentering.flatten(-2), (0, 0, 0, 1))  # the state after the last chunk is not used
    del dentering
    dchunk = _exponent_grad((dpassed @ own_states(xdt).transpose(-1, -2)).mul_(chunk_decay))  # [b, g, r, c + 1]
    da += dchunk[..., 1:].unsqueeze(-1)
    dstates = (chunk_decay.transpose(-1, -2) @ dpassed)[:, :, :, 1:].unflatten(-1, (x.shape[-1], B.shape[-1]))
    del dpassed
    dz = torch.einsum("bgcqn,bgrcpn->bgrcqp", Bs, dstates)
    dxdt += dz * to_end.unsqueeze(-1)
    # to_end is the last row of the decay matrix: its gradient reaches a[j+1..q-1] for position j.
    dlast = (dz * xdt).sum(dim=-1).mul_(to_end)
    da += F.pad(dlast[..., :-1].cumsum(dim=-1), (1, 0))
    del dz, dlast
    dB += torch.einsum("bgrcqp,bgrcpn->bgcqn", xdt.mul_(to_end.unsqueeze(-1)), dstates)  # xdt's last use
    del dstates

    # 5. a = dt A and xdt = x dt; y's D x term.
    del xdt
    dxs = dxdt * dts.unsqueeze(-1)
    if D is not None:
        dxs += dY * _skip_weights(D, g, cdt)
    del dY
    ddts = (dxdt * _laid_out((x,), q, g, cdt)[0]).sum(dim=-1) + da * As
    dAs = da * dts

    def back(t, pattern):  # from the layout to the inputs' shapes, padding trimmed
        return rearrange(t, pattern)[:, :length]

    return (
        back(dxs, "b g r c q p -> b (c q) (g r) p"),
        back(ddts, "b g r c q -> b (c q) (g r)"),
        back(dAs, "b g r c q -> b (c q) (g r)"),
        back(dB, "b g c q n -> b (c q) g n"),
        back(dC, "b g c q n -> b (c q) g n"),
    )


SLICE_BYTES = 32 * 2**20
"""Budget of one ``[batch, heads, chunks, chunk, chunk]`` decay matrix in :class:`GroupSlicedScan`
while a CUDA graph captures it: as many groups go into one slice as fit (at least one). A graph
keeps its transients reserved in the graph pool, so its slices are smaller than eager ones;
replaying costs no host time per slice, but small slices keep the GPU less busy. The recording
iteration runs a region it captures next at this budget too: it is an eager iteration, and its peak
counts as the graphed run's. An eager scan inside an eager turn keeps the eager budget, though its
transients then stay reserved in the backward pool: this budget there doubles the eager scan's
kernel launches, which set its time (:data:`TURN_BUDGET_ENV` chooses it there)."""
EAGER_SLICE_BYTES = 256 * 2**20
"""The same budget when the scan runs eagerly. The host launches some 40 kernels per slice in
forward and 110 in backward, and eagerly that launching is the scan's time, while the transient of
one layer comes and goes in the caching allocator like any other: so eager slices are large.
Slicing changes no bit of the result (groups are independent; backward takes the per-head sums
over the sequence whole, and its reductions along rows), so graphed and eager steps stay equal."""


TURN_BUDGET_ENV = "MEGATRON_CG_TURN_SCAN_BUDGET"
"""``captured``: an eager scan of a graphed run whose scratch blocks and turns allocate in the backward
graphs' pool (``cuda_graphs/scratch.py``, ``turn.py``) takes :data:`SLICE_BYTES`. That pool stays
reserved for the largest thing made in it, while eagerly the scan's working memory reuses what the
layers after it freed: graphed hybrid ``attn`` and ``mlp`` steps then peak closer to eager's, and
take longer, since an eager scan's time is its kernel launches (the README's hybrid measurements).
``eager`` (the default) keeps :data:`EAGER_SLICE_BYTES` there."""


def _slice_budget() -> int:
    """A captured scan's budget, also where the recording iteration runs a region it captures next
    (its eager peak counts as the graphed run's), and with ``MEGATRON_CG_TURN_SCAN_BUDGET=captured``
    where an eager scan's working memory goes to the backward graphs' pool; an eager scan's elsewhere."""
    if capturing() or in_recorded_region() or (_turns_take_captured_budget() and scratch_routes()):
        return SLICE_BYTES
    return EAGER_SLICE_BYTES


def _turns_take_captured_budget() -> bool:
    value = os.environ.get(TURN_BUDGET_ENV, "eager")
    if value not in ("eager", "captured"):
        raise ValueError(f"{TURN_BUDGET_ENV}={value!r}: use eager (the default) or captured")
    return value == "captured"


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
    backward recomputes what it needs of each slice and takes its gradients by hand
    (:func:`_chunked_scan_grads`) before the next.
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
        kernels = ssd_kernels.available(x)
        for heads, groups in _group_slices(x, B, chunk_size, ctx.budget):
            pieces = _slice((x, dt, A, B, C, D), heads, groups)
            with scratch():  # the slice's working memory dies here; its result goes into y
                if kernels:
                    ssd_kernels.scan(*pieces[:5], chunk_size, D=pieces[5], state_dtype=state_dtype, out=y[:, :, heads])
                else:
                    y[:, :, heads] = _chunked_scan(*pieces[:5], chunk_size, D=pieces[5], state_dtype=state_dtype)
        return y

    @staticmethod
    @once_differentiable  # gradients by hand: no graph of their own
    def backward(ctx, dy):
        grads = _sliced_backward(
            ctx.saved_tensors, ctx.needs_input_grad[:6], dy, ctx.chunk_size, ctx.state_dtype, ctx.budget
        )
        return (*grads, None, None)


def _sliced_backward(saved, needs, dy, chunk_size, state_dtype, budget=None, kernels=None) -> tuple:
    """:class:`GroupSlicedScan`'s backward: the gradients of ``x, dt, A, B, C, D`` (None where not
    needed), slices of ``budget`` bytes (default: the capture or eager one), on ``ssd_kernels`` where
    ``kernels`` (default: where they can run)."""
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
    kernels = ssd_kernels.available(x) if kernels is None else kernels
    for heads, groups in _group_slices(x, B, chunk_size, _slice_budget() if budget is None else budget):
        parts = _slice(grads, heads, groups)
        if kernels:  # dx, dB, dC straight into their slices
            found = ssd_kernels.scan_grads(
                *_slice(inputs, heads, groups),
                chunk_size,
                state_dtype,
                dy[:, :, heads],
                dx=parts[0],
                dB=parts[3],
                dC=parts[4],
            )
        else:
            found = _chunked_scan_grads(*_slice(inputs, heads, groups), chunk_size, state_dtype, dy[:, :, heads])
        for part, grad in zip(parts, found):
            if part is not None and part is not grad:
                part.copy_(grad)
        del found
    dA = grads[2].sum(dim=(0, 1)) if need_A else None
    dD = _skip_grad(dy, x, D.dim() == 2).to(D.dtype) if need_D else None
    return grads[0], grads[1], dA, grads[3], grads[4], dD


SKIP_GRAD_BYTES = 8 * 2**20
"""``_skip_grad`` widens this many bytes of ``x`` (and of ``dy``) at a time."""


def _skip_grad(dy: torch.Tensor, x: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """``D``'s gradient, ``sum dy x`` over the batch and sequence (and the head dim unless ``per_channel``),
    in the compute dtype, a block of positions at a time: the float32 copies are a block's, not ``x``'s.
    The blocks depend on the shapes only (not on any slicing), so the sum's order does too."""
    cdt = _compute_dtype(x.dtype)
    rows, xs = dy.flatten(0, 1), x.flatten(0, 1)  # [b l, h, p]
    step = max(1, SKIP_GRAD_BYTES // (xs[0].numel() * torch.empty((), dtype=cdt).element_size()))
    total = None
    for start in range(0, rows.shape[0], step):
        part = (rows[start : start + step].to(cdt) * xs[start : start + step].to(cdt)).sum(
            dim=0 if per_channel else (0, 2)
        )
        total = part if total is None else total.add_(part)
    return total


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
