"""The gated delta rule 2 (GDN2): a chunked form for training and the step-by-step recurrence as reference.

GDN2 (Gated DeltaNet-2, ``--experimental-attention-variant gdn2``) replaces the gated
delta rule's per-head decay and write strength by channel-wise gates and decouples
erasing from writing. Per head, with a state ``S [K, V]``, a per-key-channel log decay
``g_t [K]`` (<= 0), an erase gate ``b_t [K]`` and a write gate ``w_t [V]`` (both in
``[0, 1]``)::

    S   <- Diag(exp(g_t)) S
    u_t  = w_t * v_t - S^T (b_t * k_t)
    S   <- S + k_t u_t^T
    o_t  = scale * S^T q_t

that is ``S_t = (I - k_t (b_t k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t v_t)^T``.

Chunked form. Within a chunk of ``C`` steps entered with state ``S0``, let ``G`` be the
cumulative sum of ``g`` over the chunk (per channel) and, for ``j <= i``,
``<x_i, y_j>_G = sum_c x_ic y_jc exp(G_ic - G_jc)``. Unrolling gives the unit
lower-triangular system ``(I + A) U = W V - E S0`` with ``A[i, j] = <b_i k_i, k_j>_G``
for ``j < i`` and ``E = exp(G) * b * k``, so ``U = U0 - X S0`` with ``U0, X`` from one
triangular solve per chunk (all chunks at once), and then, chunk after chunk::

    O  = (exp(G) * Q) S0 + P U,   P[i, j] = <q_i, k_j>_G for j <= i
    S1 = Diag(exp(G_C)) S0 + (exp(G_C - G) * K)^T U

The channel-wise decay does not factor out of ``<., .>_G`` as a matrix product unless
each pair's exponent is split at a reference point. Here the chunk is cut into blocks:
for rows in a later block than the columns, the reference is the columns' block end
``m`` (``exp(G_i - G_m) exp(G_m - G_j)``, both exponents <= 0); within a block the
pairs are formed explicitly, masked before ``exp``. No exponent is ever positive, so
nothing overflows however strong the decay. A sequence that is not a multiple of ``C``
is padded at its end with zeros (``g = 0``), which leaves the earlier outputs and the
final state unchanged. Shapes depend only on the input shapes and the chunk sizes, and
nothing reads values on the host, so the chunked form can be captured in a CUDA graph.
Both forms compute in at least float32 (float64 stays float64) and return the output in
the dtype of ``v``.

``fla``'s GDN2 kernel (``flash-linear-attention`` >= 0.5.1, ``fla.ops.gdn2``) is used by
``gdn2_rule`` when it is installed, the input is on CUDA and deterministic algorithms
are off; it is never required.
"""

import torch

from megatron.core.ssm.gated_delta_net.gated_delta_rule import compute_dtype, pass_states, to_chunks

try:  # optional fused kernel; never required
    from fla.ops.gdn2.chunk import chunk_gdn2 as _fla_chunk_gdn2
except ImportError:  # pragma: no cover - depends on the environment
    _fla_chunk_gdn2 = None

HAVE_FLA_GDN2 = _fla_chunk_gdn2 is not None


def _block_bounds(c: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, c)) for start in range(0, c, block)]


def decayed_scores(
    x: torch.Tensor, y: torch.Tensor, cum: torch.Tensor, block: int, *, strict: bool = False
) -> torch.Tensor:
    """``M[i, j] = sum_c x_ic y_jc exp(G_ic - G_jc)`` for ``j <= i`` (``j < i`` when ``strict``), 0 above.

    Args:
        x, y: ``[..., C, K]``.
        cum: ``G``, ``[..., C, K]``, non-increasing along ``C`` (cumulative sums of ``g <= 0``).
        block: Rows per block (see the module docstring); the last block may be shorter.
        strict: Leave the diagonal out.

    Returns:
        ``[..., C, C]``.
    """
    c = x.shape[-2]
    bounds = _block_bounds(c, block)
    rows = []
    for bi, (r0, r1) in enumerate(bounds):
        parts = []
        for bj, (c0, c1) in enumerate(bounds):
            if bj < bi:  # reference: the last position of the column block
                ref = cum[..., c1 - 1 : c1, :]
                xs = x[..., r0:r1, :] * (cum[..., r0:r1, :] - ref).exp()
                ys = y[..., c0:c1, :] * (ref - cum[..., c0:c1, :]).exp()
                parts.append(xs @ ys.transpose(-1, -2))
            elif bj == bi:  # pairs within the block, masked before exp
                n = r1 - r0
                keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
                g = cum[..., r0:r1, :]
                diff = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(~keep.unsqueeze(-1), float("-inf"))
                parts.append((x[..., r0:r1, None, :] * y[..., None, c0:c1, :] * diff.exp()).sum(-1))
            else:
                parts.append(x.new_zeros(*x.shape[:-2], r1 - r0, c1 - c0))
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=-2)


def chunk_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    chunk_size: int = 64,
    *,
    block_size: int = 16,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The GDN2 rule over a sequence, chunk by chunk (see the module docstring).

    Args:
        q, k: ``[b, l, h, K]`` (usually L2-normalised).
        v: ``[b, l, h, V]``.
        g: ``[b, l, h, K]`` channel-wise log decay (<= 0).
        b: ``[b, l, h, K]`` channel-wise erase gate (in ``[0, 1]``).
        w: ``[b, l, h, V]`` channel-wise write gate (in ``[0, 1]``).
        chunk_size: Steps per chunk.
        block_size: Steps per block inside a chunk (pairs within a block are formed explicitly).
        scale: Query scale; default ``K ** -0.5``.
        initial_state: ``[b, h, K, V]`` state before the first step, or None (zeros).
        output_final_state: Also return the state after the last step.

    Returns:
        ``(o [b, l, h, V] in v's dtype, final state [b, h, K, V] in the compute dtype or None)``.
    """
    batch, length, h, dk = k.shape
    dv, out_dtype, dtype = v.shape[-1], v.dtype, compute_dtype(v)
    scale = dk**-0.5 if scale is None else scale
    c = chunk_size

    q, k, v, g, b, w = (to_chunks(t, c, dtype) for t in (q, k, v, g, b, w))
    q = q * scale

    cum = g.cumsum(dim=-2)  # G: [b, h, n, c, K]
    erase_key = b * k
    # The strictly lower part of I + A; solve_triangular(unitriangular=True) never reads the diagonal.
    a = decayed_scores(erase_key, k, cum, block_size, strict=True)
    rhs = torch.cat([cum.exp() * erase_key, w * v], dim=-1)  # [E, W V]
    x, u0 = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split([dk, dv], dim=-1)
    qk = decayed_scores(q, k, cum, block_size)  # P
    q_decayed = q * cum.exp()  # exp(G) * Q
    last = cum[..., -1:, :]  # G_C: [b, h, n, 1, K]
    k_to_end = k * (last - cum).exp()  # exp(G_C - G) * K
    chunk_decay = last.transpose(-1, -2).exp()  # exp(G_C) per key channel: [b, h, n, K, 1]

    state = k.new_zeros(batch, h, dk, dv) if initial_state is None else initial_state.to(dtype)
    o, state = pass_states(u0, x, q_decayed, qk, chunk_decay, k_to_end, state, length)
    return o.to(out_dtype), (state if output_final_state else None)


def recurrent_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence of the module docstring, one step at a time (the reference; same arguments and
    results as ``chunk_gdn2``)."""
    batch, length, h, dk = k.shape
    dv, out_dtype, dtype = v.shape[-1], v.dtype, compute_dtype(v)
    scale = dk**-0.5 if scale is None else scale
    q, k, v, g, b, w = (t.to(dtype) for t in (q, k, v, g, b, w))
    state = k.new_zeros(batch, h, dk, dv) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(length):
        state = state * g[:, t].exp().unsqueeze(-1)
        u = w[:, t] * v[:, t] - torch.einsum("bhkv,bhk->bhv", state, b[:, t] * k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(batch, 0, h, dv)
    return o.to(out_dtype), (state if output_final_state else None)


def gdn2_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    chunk_size: int = 64,
    *,
    use_fused: bool | None = None,
) -> torch.Tensor:
    """The GDN2 rule's output ``[b, l, h, V]``: fla's kernel or ``chunk_gdn2``.

    Args:
        q, k, v, g, b, w: As for ``chunk_gdn2``.
        chunk_size: Chunk length of the PyTorch path (fla's kernel has its own).
        use_fused: Use fla's kernel (None: when installed, on CUDA and with deterministic
            algorithms off).
    """
    if use_fused is None:
        use_fused = HAVE_FLA_GDN2 and q.is_cuda and not torch.are_deterministic_algorithms_enabled()
    if use_fused:
        if not HAVE_FLA_GDN2:
            raise RuntimeError("use_fused=True needs fla's GDN2 kernel (pip install 'flash-linear-attention>=0.5.1')")
        o, _ = _fla_chunk_gdn2(q=q, k=k, v=v, g=g, b=b, w=w, use_qk_l2norm_in_kernel=False)
        return o
    return chunk_gdn2(q, k, v, g, b, w, chunk_size)[0]
