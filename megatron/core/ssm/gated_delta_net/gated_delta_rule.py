"""The gated delta rule: a chunked form for training and the step-by-step recurrence as reference.

Per head, a state ``S [K, V]`` is decayed, then moved towards each new key/value pair
(the delta rule with a data-dependent decay; Yang, Kautz and Hatamizadeh, "Gated Delta
Networks", 2024), and read by the query::

    S   <- exp(g_t) * S
    u_t  = beta_t * (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = scale * S^T q_t

Chunked form. Within a chunk of ``C`` steps entered with state ``S0``, let ``G`` be the
cumulative sum of ``g`` and ``D[i, j] = exp(G_i - G_j)`` for ``j <= i`` (0 above the
diagonal). Unrolling gives ``u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} D[i, j]
(k_i . k_j) u_j)``, a unit lower-triangular system ``(I + A) U = beta V - (beta exp(G) K) S0``
with ``A[i, j] = beta_i D[i, j] (k_i . k_j)`` for ``j < i``. So ``U = U0 - W S0`` with
``U0, W`` from one triangular solve per chunk (independent of ``S0``: all chunks at once),
and then, chunk after chunk::

    O  = (exp(G) * Q) S0 + (D * Q K^T) U
    S1 = exp(G_C) S0 + (exp(G_C - G) * K)^T U

Every exponent is <= 0 (``g <= 0``), so nothing overflows. A sequence that is not a
multiple of ``C`` is padded at its end with ``k = v = q = 0``, ``beta = 0``, ``g = 0``,
which leaves the earlier outputs and the final state unchanged. Shapes depend only on the
input shapes and the chunk size, and nothing reads values on the host, so the chunked
form can be captured in a CUDA graph. Both forms compute in at least float32 (float64
stays float64) and return the output in the dtype of ``v``.

``fla``'s fused kernel (``flash-linear-attention``) is used by ``gated_delta_rule`` when
it is installed, the input is on CUDA and deterministic algorithms are off; it is never
required.
"""

import torch
import torch.nn.functional as F
from einops import rearrange

try:  # optional fused kernel; never required
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
except ImportError:  # pragma: no cover - depends on the environment
    _fla_chunk_gated_delta_rule = None

HAVE_FLA = _fla_chunk_gated_delta_rule is not None


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the rules compute in: at least float32."""
    return torch.promote_types(t.dtype, torch.float32)


def to_chunks(t: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[b, l, h(, d)]`` -> ``[b, h, n, c(, d)]`` in ``dtype``, zero-padded to ``n * c`` steps."""
    t = t.to(dtype)
    pad = -t.shape[1] % chunk_size
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return rearrange(t, "b (n c) h ... -> b h n c ...", c=chunk_size)


def pass_states(u0, x, q_decayed, qk, chunk_decay, k_to_end, state, length: int):
    """The chunk-to-chunk part shared by the chunked rules: each chunk's output from the state
    entering it, and the state it passes on. Per chunk ``i`` (all ``[b, h, n, ...]``):
    ``u = u0_i - x_i S``, ``o_i = q_decayed_i S + qk_i u``, ``S <- chunk_decay_i * S + k_to_end_i^T u``.

    Returns:
        ``(o [b, length, h, V], final state)``, both in the compute dtype.
    """
    outputs = []
    for i in range(u0.shape[2]):
        u = u0[:, :, i] - x[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + qk[:, :, i] @ u)
        state = chunk_decay[:, :, i] * state + k_to_end[:, :, i].transpose(-1, -2) @ u
    return rearrange(torch.stack(outputs, dim=2), "b h n c d -> b (n c) h d")[:, :length], state


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, in at least float32 (fla's ``l2norm``)."""
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a sequence, chunk by chunk (see the module docstring).

    Args:
        q, k: ``[b, l, h, K]`` (keys are usually L2-normalised).
        v: ``[b, l, h, V]``.
        g: ``[b, l, h]`` log decay (<= 0).
        beta: ``[b, l, h]`` write strength (in ``[0, 1]``).
        chunk_size: Steps per chunk.
        scale: Query scale; default ``K ** -0.5``.
        initial_state: ``[b, h, K, V]`` state before the first step, or None (zeros).
        output_final_state: Also return the state after the last step.

    Returns:
        ``(o [b, l, h, V] in v's dtype, final state [b, h, K, V] in the compute dtype or None)``.
    """
    b, length, h, dk = k.shape
    dv, out_dtype, dtype = v.shape[-1], v.dtype, compute_dtype(v)
    scale = dk**-0.5 if scale is None else scale
    c = chunk_size

    q, k, v, g, beta = (to_chunks(t, c, dtype) for t in (q, k, v, g, beta))
    q = q * scale

    cum = g.cumsum(dim=-1)  # G: [b, h, n, c]
    causal = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    # D[i, j] = exp(G_i - G_j) on and below the diagonal, 0 above (masked before exp: no overflow).
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    # The strictly lower part of I + A; solve_triangular(unitriangular=True) never reads the diagonal.
    a = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([(beta * cum.exp()).unsqueeze(-1) * k, beta.unsqueeze(-1) * v], dim=-1)
    w, u0 = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split([dk, dv], dim=-1)
    qk = (q @ k.transpose(-1, -2)) * decay  # D * Q K^T
    q_decayed = q * cum.exp().unsqueeze(-1)  # exp(G) * Q
    last = cum[..., -1:]  # G_C: [b, h, n, 1]
    k_to_end = k * (last - cum).exp().unsqueeze(-1)  # exp(G_C - G) * K
    chunk_decay = last.exp().unsqueeze(-1)  # exp(G_C): [b, h, n, 1, 1]

    state = k.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(dtype)
    o, state = pass_states(u0, w, q_decayed, qk, chunk_decay, k_to_end, state, length)
    return o.to(out_dtype), (state if output_final_state else None)


def sequential_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence of the module docstring, one step at a time (the reference; same arguments and
    results as ``chunk_gated_delta_rule``)."""
    b, length, h, dk = k.shape
    dv, out_dtype, dtype = v.shape[-1], v.dtype, compute_dtype(v)
    scale = dk**-0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    state = k.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(b, 0, h, dv)
    return o.to(out_dtype), (state if output_final_state else None)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    *,
    use_fused: bool | None = None,
) -> torch.Tensor:
    """The gated delta rule's output ``[b, l, h, V]``: fla's kernel or ``chunk_gated_delta_rule``.

    Args:
        q, k, v, g, beta: As for ``chunk_gated_delta_rule``.
        chunk_size: Chunk length of the PyTorch path (fla's kernel has its own).
        use_fused: Use fla's kernel (None: when installed, on CUDA and with deterministic
            algorithms off; fla's backward is not deterministic).
    """
    if use_fused is None:
        use_fused = HAVE_FLA and q.is_cuda and not torch.are_deterministic_algorithms_enabled()
    if use_fused:
        if not HAVE_FLA:
            raise RuntimeError("use_fused=True needs fla (pip install flash-linear-attention)")
        o, _ = _fla_chunk_gated_delta_rule(q, k, v, g, beta)
        return o
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size)[0]
