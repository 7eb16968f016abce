"""The SSD chunked scan (``ssd.py``) as a few Triton kernels: no ``[chunk, chunk]`` matrix in memory.

The PyTorch scan materializes, per head and chunk, the decay matrix and ``C B^T`` (and in backward
their gradients), and launches some 40 kernels per slice of groups forward and 110 backward. Here
each output tile forms those products in registers from ``B``, ``C``, ``x``, ``dt`` and the
within-chunk cumulative sums of ``dt A``, so memory holds only the per-chunk states
(``[b, chunks, heads, p, n]`` float32: the states each chunk makes, turned in place into the states
entering each chunk; in backward also their gradients). Forward is three kernels, backward six, plus
a few small PyTorch ops on ``[b, l, heads]`` tensors.

The math is ``ssd._chunked_scan``'s, in float32, in another order. Matrix products of float32
tiles are IEEE float32 (no TF32); those of two bf16 or fp16 input tiles, such as ``C B^T``, run on
the tensor cores (the products are exact in float32, the sums float32). The decay between
positions ``j <= i`` of a chunk is ``exp(cum_i - cum_j)`` of the within-chunk sums, taken in
float64 (not a sum of the increments); the states pass along the chunks one at a time; the gradient
of the sums comes from row and column sums of the scores. So results differ from the PyTorch scan
in the last bits, not between eager and graphed runs, which both take this path.
Every reduction runs in one fixed order with no atomics (deterministic), and a group's heads are
summed inside one program, so slicing the heads into whole groups changes no bit.

Inputs are read through their strides (views of slices of heads are fine); float32, bfloat16 and
float16 only (float64 takes the PyTorch scan). On the CPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``), which the tests use.
"""

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs, or a platform without Triton
    HAVE_TRITON = False

ENV_SWITCH = "MEGATRON_SSD_KERNELS"
"""``triton`` (the default) runs the Mamba scan on these kernels where they can run (CUDA, or the
interpreter); ``torch`` keeps the PyTorch scan everywhere."""

_ROUND = {torch.bfloat16: 1, torch.float16: 2}
"""How the states entering each chunk are rounded (``state_dtype``), as a kernel constant (0: not)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _switched_on() -> bool:
    value = os.environ.get(ENV_SWITCH, "triton")
    if value not in ("torch", "triton"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: use triton (the default) or torch")
    return value == "triton"


def takes(dtype: torch.dtype) -> bool:
    """Whether a scan of ``dtype`` inputs on a device Triton runs on takes these kernels: Triton
    importable, :data:`ENV_SWITCH` not ``torch``, and a float32, bf16 or fp16 ``dtype``."""
    return _switched_on() and HAVE_TRITON and dtype in (torch.float32, torch.bfloat16, torch.float16)


def available(x: torch.Tensor) -> bool:
    """Whether the scan of ``x`` runs on these kernels: :func:`takes` its dtype, and ``x`` is on CUDA
    (or the interpreter is on)."""
    return takes(x.dtype) and (x.is_cuda or _interpreting())


def _pow2(value: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(value))


def _round_code(state_dtype: torch.dtype | None, x_dtype: torch.dtype) -> int:
    return _ROUND.get(x_dtype if state_dtype is None else state_dtype, 0)


if HAVE_TRITON:

    @triton.jit
    def _exp32(v):
        """``exp`` in float32 of an exponent formed in float64 (differences of the within-chunk sums)."""
        return tl.exp(v.to(tl.float32))

    @triton.jit
    def _rounded(v, ROUND: tl.constexpr):
        """``v`` (float32) rounded to the states' dtype: 1 bf16, 2 fp16, 0 unchanged."""
        if ROUND == 1:
            v = v.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            v = v.to(tl.float16).to(tl.float32)
        return v

    @triton.jit
    def _row_slice(ptr, s_b, s_l, s_h, s_d, bi, pos, head, width, valid, first, BD: tl.constexpr):
        """``[len(pos), BD]`` tile of a ``[b, l, heads, width]`` tensor, columns from ``first``, in its
        dtype (zeros outside)."""
        cols = first + tl.arange(0, BD)
        mask = valid[:, None] & (cols[None, :] < width)
        return tl.load(ptr + bi * s_b + pos[:, None] * s_l + head * s_h + cols[None, :] * s_d, mask=mask, other=0.0)

    @triton.jit
    def _raw_rows(ptr, s_b, s_l, s_h, s_d, bi, pos, head, width, valid, BD: tl.constexpr):
        """``[len(pos), BD]`` tile of a ``[b, l, heads, width]`` tensor in its dtype (zeros outside)."""
        return _row_slice(ptr, s_b, s_l, s_h, s_d, bi, pos, head, width, valid, 0, BD)

    @triton.jit
    def _rows(ptr, s_b, s_l, s_h, s_d, bi, pos, head, width, valid, BD: tl.constexpr):
        """:func:`_raw_rows` in float32."""
        return _raw_rows(ptr, s_b, s_l, s_h, s_d, bi, pos, head, width, valid, BD).to(tl.float32)

    _HALF_DOTS_IN_FLOAT32 = tl.constexpr(_interpreting())
    """The interpreter multiplies bf16 tiles as their raw bits: there they go to float32 first (the
    same products, exact in float32 either way)."""

    @triton.jit
    def _dot(a, b):
        """``a @ b`` in float32: IEEE float32 products of float32 tiles (no TF32); bf16 or fp16 tiles
        on the tensor cores, whose products are exact in float32, summed in float32."""
        if a.dtype == tl.float32:
            return tl.dot(a, b, input_precision="ieee")
        elif _HALF_DOTS_IN_FLOAT32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b, out_dtype=tl.float32)

    @triton.jit
    def _block(start, block, q, length, BQ: tl.constexpr):
        """Block ``block`` of a chunk's positions: (index in the chunk, position in the sequence, in both)."""
        index = block * BQ + tl.arange(0, BQ)
        pos = start + index
        return index, pos, (index < q) & (pos < length)

    @triton.jit
    def _store_rows(ptr, s_b, s_l, s_h, s_d, bi, pos, head, width, valid, value, BD: tl.constexpr):
        """Writes ``value`` ``[len(pos), BD]`` into a ``[b, l, heads, width]`` tensor (in its dtype)."""
        cols = tl.arange(0, BD)
        mask = valid[:, None] & (cols[None, :] < width)
        ptrs = ptr + bi * s_b + pos[:, None] * s_l + head * s_h + cols[None, :] * s_d
        tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _skip_row(d_ptr, sd_h, sd_p, head, p, BP: tl.constexpr):
        """``[1, BP]``: head ``head``'s row of ``D [heads, p]`` (a per-head D comes with stride 0 along p)."""
        cols = tl.arange(0, BP)
        return tl.load(d_ptr + head * sd_h + cols * sd_p, mask=cols < p, other=0.0)[None, :]

    @triton.jit
    def _state_slice(ptr, index, p, n, row, col, BP: tl.constexpr, BN: tl.constexpr):
        """``[BP, BN]`` from ``(row, col)`` of the ``index``-th ``[p, n]`` state of a contiguous float32
        state buffer (zeros outside)."""
        rows = row + tl.arange(0, BP)
        cols = col + tl.arange(0, BN)
        mask = (rows[:, None] < p) & (cols[None, :] < n)
        return tl.load(ptr + index * p * n + rows[:, None] * n + cols[None, :], mask=mask, other=0.0)

    # Products with a state run _BK of their inner dim (n or p) at a time: a float32 product holds
    # its operands' whole inner dim in registers, which spilled kilobytes a thread at n = 128. The
    # slices add up in the inner dim's order.

    @triton.jit
    def _rows_times_state_t(
        ptr, s_b, s_l, s_h, s_d, bi, pos, head, valid, st_ptr, index, p, n,
        ROUND: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """``[BQ, BP]`` float32: rows ``pos`` of a ``[b, l, heads, n]`` tensor times the transposed
        ``index``-th state (``[p, n]``, rounded by ``ROUND``)."""
        acc = tl.zeros([BQ, BP], dtype=tl.float32)
        for k in range(0, tl.cdiv(n, BK)):
            rows = _row_slice(ptr, s_b, s_l, s_h, s_d, bi, pos, head, n, valid, k * BK, BK).to(tl.float32)
            state = _rounded(_state_slice(st_ptr, index, p, n, 0, k * BK, BP, BK), ROUND)
            acc = tl.dot(rows, tl.trans(state), acc, input_precision="ieee")
        return acc

    @triton.jit
    def _rows_times_state(
        ptr, s_b, s_l, s_h, s_d, bi, pos, head, valid, weights, st_ptr, index, p, n,
        ROUND: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """``[BQ, BN]`` float32: rows ``pos`` of a ``[b, l, heads, p]`` tensor, each times its
        ``weights`` entry, times the ``index``-th state (``[p, n]``, rounded by ``ROUND``)."""
        acc = tl.zeros([BQ, BN], dtype=tl.float32)
        for k in range(0, tl.cdiv(p, BK)):
            rows = _row_slice(ptr, s_b, s_l, s_h, s_d, bi, pos, head, p, valid, k * BK, BK).to(tl.float32)
            state = _rounded(_state_slice(st_ptr, index, p, n, k * BK, 0, BK, BN), ROUND)
            acc = tl.dot(rows * weights[:, None], state, acc, input_precision="ieee")
        return acc

    @triton.jit
    def _chunk_states_kernel(
        u_ptr, su_b, su_l, su_h, su_p,  # x (forward) or dy (backward): [b, l, heads, p]
        dt_ptr, sdt_b, sdt_l, sdt_h,  # [b, l, heads]
        cum_ptr,  # [b, chunks * q, heads] contiguous float64: within-chunk sums of dt A
        v_ptr, sv_b, sv_l, sv_g, sv_n,  # B (forward) or C (backward): [b, l, groups, n]
        out_ptr,  # [b, chunks, heads, p, n] float32
        length, q, chunks, heads, r, p, n,
        TO_END: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        """Per chunk and head, ``sum_j w_j u_j^T v_j``: with ``TO_END`` the state the chunk makes
        (``w_j = exp(cum_last - cum_j) dt_j``, ``u = x``, ``v = B``), else the gradient of the state
        entering it (``w_i = exp(cum_i)``, ``u = dy``, ``v = C``)."""
        bc = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        bi = bc // chunks
        start = (bc % chunks) * q
        cum_row = cum_ptr + bi * (chunks * q * heads) + head
        last = tl.load(cum_row + (start + q - 1) * heads)
        acc = tl.zeros([BP, BN], dtype=tl.float32)
        for tb in range(0, tl.cdiv(q, BQ)):
            t, pos, valid = _block(start, tb, q, length, BQ)
            cum = tl.load(cum_row + pos * heads, mask=t < q, other=0.0)
            if TO_END:
                dt = tl.load(dt_ptr + bi * sdt_b + pos * sdt_l + head * sdt_h, mask=valid, other=0.0)
                w = _exp32(tl.where(valid, last - cum, float("-inf"))) * dt
            else:
                w = _exp32(tl.where(valid, cum, float("-inf")))
            u = _rows(u_ptr, su_b, su_l, su_h, su_p, bi, pos, head, p, valid, BP) * w[:, None]
            v = _rows(v_ptr, sv_b, sv_l, sv_g, sv_n, bi, pos, head // r, n, valid, BN)
            acc += tl.dot(tl.trans(u), v, input_precision="ieee")
        rows = tl.arange(0, BP)
        cols = tl.arange(0, BN)
        mask = (rows[:, None] < p) & (cols[None, :] < n)
        tl.store(out_ptr + (bc * heads + head) * p * n + rows[:, None] * n + cols[None, :], acc, mask=mask)

    @triton.jit
    def _pass_states_kernel(st_ptr, cum_ptr, length_q, q, chunks, heads, pn, BLOCK: tl.constexpr):
        """In place: each chunk's own state becomes the state entering it (float32, unrounded),
        ``S_0 = 0, S_{c+1} = exp(cum_last_c) S_c + own_c``, one chunk after the other."""
        bh = tl.program_id(0).to(tl.int64)
        bi = bh // heads
        head = bh % heads
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < pn
        state = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(chunks):
            ptr = st_ptr + ((bi * chunks + c) * heads + head) * pn + offs
            own = tl.load(ptr, mask=mask, other=0.0)
            tl.store(ptr, state, mask=mask)
            decay = _exp32(tl.load(cum_ptr + (bi * length_q + c * q + q - 1) * heads + head))
            state = decay * state + own

    @triton.jit
    def _pass_states_backward_kernel(
        grad_ptr, st_ptr, cum_ptr, dsum_ptr, length_q, q, chunks, heads, pn, blocks,
        ROUND: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Back through :func:`_pass_states_kernel`, in place: the gradient of the state entering each
        chunk (rounded as the states were) becomes that of the state the chunk makes; ``dsum``
        ``[b, heads, blocks, chunks]`` gets this block's part of each chunk's ``cum_last`` gradient."""
        bh = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        bi = bh // heads
        head = bh % heads
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < pn
        after = tl.zeros([BLOCK], dtype=tl.float32)  # the gradient of S_{c+1}
        for k in range(chunks):
            c = chunks - 1 - k
            index = ((bi * chunks + c) * heads + head) * pn + offs
            entering = _rounded(tl.load(grad_ptr + index, mask=mask, other=0.0), ROUND)
            decay = _exp32(tl.load(cum_ptr + (bi * length_q + c * q + q - 1) * heads + head))
            state = tl.load(st_ptr + index, mask=mask, other=0.0)  # S_c
            tl.store(dsum_ptr + (bh * blocks + block) * chunks + c, tl.sum(after * state, axis=0) * decay)
            tl.store(grad_ptr + index, after, mask=mask)
            after = entering + decay * after

    @triton.jit
    def _chunk_out_kernel(
        x_ptr, sx_b, sx_l, sx_h, sx_p,
        dt_ptr, sdt_b, sdt_l, sdt_h,
        cum_ptr,
        b_ptr, sb_b, sb_l, sb_g, sb_n,
        c_ptr, sc_b, sc_l, sc_g, sc_n,
        st_ptr,  # [b, chunks, heads, p, n]: the states entering each chunk
        d_ptr, sd_h, sd_p,
        y_ptr, sy_b, sy_l, sy_h, sy_p,
        length, q, chunks, heads, r, p, n,
        HAS_D: tl.constexpr, ROUND: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """``y_i = exp(cum_i) C_i . S + sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j (+ D x_i)``
        for one block of rows ``i`` of one chunk and head."""
        bc = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        ib = tl.program_id(2)
        bi = bc // chunks
        start = (bc % chunks) * q
        group = head // r
        cum_row = cum_ptr + bi * (chunks * q * heads) + head
        i, pos_i, valid_i = _block(start, ib, q, length, BQ)
        cum_i = tl.load(cum_row + pos_i * heads, mask=i < q, other=0.0)
        c_raw = _raw_rows(c_ptr, sc_b, sc_l, sc_g, sc_n, bi, pos_i, group, n, valid_i, BN)
        acc = _rows_times_state_t(
            c_ptr, sc_b, sc_l, sc_g, sc_n, bi, pos_i, group, valid_i, st_ptr, bc * heads + head, p, n, ROUND, BQ, BP, BK,
        ) * _exp32(cum_i)[:, None]  # fmt: skip
        for jb in range(0, ib + 1):
            j, pos_j, valid_j = _block(start, jb, q, length, BQ)
            cum_j = tl.load(cum_row + pos_j * heads, mask=j < q, other=0.0)
            dt_j = tl.load(dt_ptr + bi * sdt_b + pos_j * sdt_l + head * sdt_h, mask=valid_j, other=0.0)
            keep = (i[:, None] >= j[None, :]) & valid_j[None, :]
            decay = _exp32(tl.where(keep, cum_i[:, None] - cum_j[None, :], float("-inf")))
            cb = _dot(c_raw, tl.trans(_raw_rows(b_ptr, sb_b, sb_l, sb_g, sb_n, bi, pos_j, group, n, valid_j, BN)))
            x_j = _rows(x_ptr, sx_b, sx_l, sx_h, sx_p, bi, pos_j, head, p, valid_j, BP)
            acc += tl.dot(cb * decay * dt_j[None, :], x_j, input_precision="ieee")
        if HAS_D:
            acc += _rows(x_ptr, sx_b, sx_l, sx_h, sx_p, bi, pos_i, head, p, valid_i, BP) * _skip_row(
                d_ptr, sd_h, sd_p, head, p, BP
            )
        _store_rows(y_ptr, sy_b, sy_l, sy_h, sy_p, bi, pos_i, head, p, valid_i, acc, BP)

    @triton.jit
    def _backward_columns_kernel(
        x_ptr, sx_b, sx_l, sx_h, sx_p,
        dt_ptr, sdt_b, sdt_l, sdt_h,
        cum_ptr,
        b_ptr, sb_b, sb_l, sb_g, sb_n,
        c_ptr, sc_b, sc_l, sc_g, sc_n,
        dy_ptr, sdy_b, sdy_l, sdy_h, sdy_p,
        dst_ptr,  # [b, chunks, heads, p, n]: the gradients of the states each chunk makes
        d_ptr, sd_h, sd_p,
        dx_ptr, sdx_b, sdx_l, sdx_h, sdx_p,
        db_ptr, sdb_b, sdb_l, sdb_g, sdb_n,
        ddt_ptr, dcum_ptr, seg_ptr,  # [b, chunks * q, heads] float32 each
        length, q, chunks, heads, r, p, n, blocks,
        HAS_D: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """One block of columns ``j`` (source positions) of one chunk and group: ``dx``, ``dB``, the
        ``x``-side part of ``ddt``, and per head the column sums of the scores (``dcum_j``) and the
        gradient through ``exp(cum_last - cum_j)`` (``seg_j``)."""
        bc = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1).to(tl.int64)
        jb = tl.program_id(2)
        bi = bc // chunks
        start = (bc % chunks) * q
        j, pos_j, valid_j = _block(start, jb, q, length, BQ)
        b_raw = _raw_rows(b_ptr, sb_b, sb_l, sb_g, sb_n, bi, pos_j, group, n, valid_j, BN)
        db = tl.zeros([BQ, BN], dtype=tl.float32)
        for k in range(r):
            head = group * r + k
            cum_row = cum_ptr + bi * (chunks * q * heads) + head
            cum_j = tl.load(cum_row + pos_j * heads, mask=j < q, other=0.0)
            last = tl.load(cum_row + (start + q - 1) * heads)
            dt_j = tl.load(dt_ptr + bi * sdt_b + pos_j * sdt_l + head * sdt_h, mask=valid_j, other=0.0)
            x_raw = _raw_rows(x_ptr, sx_b, sx_l, sx_h, sx_p, bi, pos_j, head, p, valid_j, BP)
            x_j = x_raw.to(tl.float32)
            to_end = _exp32(tl.where(valid_j, last - cum_j, float("-inf")))
            index = bc * heads + head
            b_dst = _rows_times_state_t(
                b_ptr, sb_b, sb_l, sb_g, sb_n, bi, pos_j, group, valid_j, dst_ptr, index, p, n, 0, BQ, BP, BK
            )  # [j, p]
            dxdt = b_dst * to_end[:, None]
            seg = tl.sum(x_j * dxdt, axis=1) * dt_j
            db += _rows_times_state(
                x_ptr, sx_b, sx_l, sx_h, sx_p, bi, pos_j, head, valid_j, to_end * dt_j, dst_ptr, index, p, n, 0, BQ, BN, BK,
            )  # fmt: skip
            col = tl.zeros([BQ], dtype=tl.float32)
            for ib in range(jb, blocks):
                i, pos_i, valid_i = _block(start, ib, q, length, BQ)
                cum_i = tl.load(cum_row + pos_i * heads, mask=i < q, other=0.0)
                c_raw = _raw_rows(c_ptr, sc_b, sc_l, sc_g, sc_n, bi, pos_i, group, n, valid_i, BN)
                dy_raw = _raw_rows(dy_ptr, sdy_b, sdy_l, sdy_h, sdy_p, bi, pos_i, head, p, valid_i, BP)
                keep = (i[None, :] >= j[:, None]) & valid_i[None, :]  # [j, i]
                decay = _exp32(tl.where(keep, cum_i[None, :] - cum_j[:, None], float("-inf")))
                scores = _dot(b_raw, tl.trans(c_raw)) * decay  # (C_i . B_j) decay, [j, i]
                dxdt += _dot(scores, dy_raw.to(tl.float32))
                dscores = _dot(x_raw, tl.trans(dy_raw)) * dt_j[:, None]  # [j, i]
                col += tl.sum(tl.where(keep & (i[None, :] > j[:, None]), dscores * scores, 0.0), axis=1)
                db += _dot(dscores * decay, c_raw.to(tl.float32))
            dx = dxdt * dt_j[:, None]
            if HAS_D:
                dy_j = _rows(dy_ptr, sdy_b, sdy_l, sdy_h, sdy_p, bi, pos_j, head, p, valid_j, BP)
                dx += dy_j * _skip_row(d_ptr, sd_h, sd_p, head, p, BP)
            _store_rows(dx_ptr, sdx_b, sdx_l, sdx_h, sdx_p, bi, pos_j, head, p, valid_j, dx, BP)
            out = bi * (chunks * q * heads) + pos_j * heads + head
            tl.store(ddt_ptr + out, tl.sum(dxdt * x_j, axis=1), mask=j < q)
            tl.store(dcum_ptr + out, -col, mask=j < q)
            tl.store(seg_ptr + out, seg, mask=j < q)
        _store_rows(db_ptr, sdb_b, sdb_l, sdb_g, sdb_n, bi, pos_j, group, n, valid_j, db, BN)

    @triton.jit
    def _backward_rows_kernel(
        x_ptr, sx_b, sx_l, sx_h, sx_p,
        dt_ptr, sdt_b, sdt_l, sdt_h,
        cum_ptr,
        b_ptr, sb_b, sb_l, sb_g, sb_n,
        c_ptr, sc_b, sc_l, sc_g, sc_n,
        dy_ptr, sdy_b, sdy_l, sdy_h, sdy_p,
        st_ptr,  # [b, chunks, heads, p, n]: the states entering each chunk
        dc_ptr, sdc_b, sdc_l, sdc_g, sdc_n,
        drow_ptr,  # [b, chunks * q, heads] float32
        length, q, chunks, heads, r, p, n,
        ROUND: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """One block of rows ``i`` (output positions) of one chunk and group: ``dC``, and per head the
        row sums of the scores plus the entering state's term (``dcum_i``)."""
        bc = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1).to(tl.int64)
        ib = tl.program_id(2)
        bi = bc // chunks
        start = (bc % chunks) * q
        i, pos_i, valid_i = _block(start, ib, q, length, BQ)
        c_raw = _raw_rows(c_ptr, sc_b, sc_l, sc_g, sc_n, bi, pos_i, group, n, valid_i, BN)
        c_i = c_raw.to(tl.float32)
        dc = tl.zeros([BQ, BN], dtype=tl.float32)
        for k in range(r):
            head = group * r + k
            cum_row = cum_ptr + bi * (chunks * q * heads) + head
            cum_i = tl.load(cum_row + pos_i * heads, mask=i < q, other=0.0)
            dy_raw = _raw_rows(dy_ptr, sdy_b, sdy_l, sdy_h, sdy_p, bi, pos_i, head, p, valid_i, BP)
            from_start = _exp32(cum_i)
            dy_state = _rows_times_state(
                dy_ptr, sdy_b, sdy_l, sdy_h, sdy_p, bi, pos_i, head, valid_i, tl.full([BQ], 1.0, tl.float32), st_ptr,
                bc * heads + head, p, n, ROUND, BQ, BN, BK,
            )  # fmt: skip
            dc += dy_state * from_start[:, None]
            row = tl.sum(c_i * dy_state, axis=1) * from_start
            for jb in range(0, ib + 1):
                j, pos_j, valid_j = _block(start, jb, q, length, BQ)
                cum_j = tl.load(cum_row + pos_j * heads, mask=j < q, other=0.0)
                dt_j = tl.load(dt_ptr + bi * sdt_b + pos_j * sdt_l + head * sdt_h, mask=valid_j, other=0.0)
                b_raw = _raw_rows(b_ptr, sb_b, sb_l, sb_g, sb_n, bi, pos_j, group, n, valid_j, BN)
                x_raw = _raw_rows(x_ptr, sx_b, sx_l, sx_h, sx_p, bi, pos_j, head, p, valid_j, BP)
                keep = (i[:, None] >= j[None, :]) & valid_j[None, :]
                decay = _exp32(tl.where(keep, cum_i[:, None] - cum_j[None, :], float("-inf")))
                dscores = _dot(dy_raw, tl.trans(x_raw)) * dt_j[None, :]  # [i, j]
                cb = _dot(c_raw, tl.trans(b_raw))
                row += tl.sum(tl.where(keep & (i[:, None] > j[None, :]), dscores * cb * decay, 0.0), axis=1)
                dc += _dot(dscores * decay, b_raw.to(tl.float32))
            tl.store(drow_ptr + bi * (chunks * q * heads) + pos_i * heads + head, row, mask=i < q)
        _store_rows(dc_ptr, sdc_b, sdc_l, sdc_g, sdc_n, bi, pos_i, group, n, valid_i, dc, BN)


_BQ_FORWARD, _BQ_BACKWARD = 64, 32
"""Rows of a chunk per program: the fastest of the tiles timed on an H100 at the hybrid benchmark's
shapes (``tools/bench_mamba.py --triton-rows``), though the backward kernels spill some registers
there (``tools/ssd_kernel_resources.py`` prints them; the README has the numbers)."""
_WARPS = 8
"""Warps of every kernel but the passing ones."""
_BK = 16
"""Inner-dim slice of the products with a state (the least ``tl.dot`` takes)."""
_PASS_BLOCK = 1024


def _launch(kernel, grid, *args, **constants) -> None:
    """``kernel[grid](*args, **constants)``, skipped on the meta device: there only what the scan
    allocates is traced (``ssd_trace.captured_backward_peak_bytes``)."""
    if args[0].device.type != "meta":
        kernel[grid](*args, **constants)


def _cumsums(dt: torch.Tensor, A: torch.Tensor, q: int) -> tuple[torch.Tensor, int]:
    """``[b, chunks * q, heads]`` within-chunk cumulative sums of ``dt A`` (the padding adds 0), and
    the number of chunks. ``A`` is ``[heads]`` or per position ``[b, l, heads]``. The sums are
    contiguous whatever ``dt``'s strides (the kernels index them so). The products are float32, as
    the PyTorch scan's; their sums float64, so that the decay ``exp(cum_i - cum_j)`` between two
    positions keeps float32 accuracy however far the sums have run (the PyTorch scan sums the
    increments between them instead)."""
    b, length, h = dt.shape
    chunks = -(-length // q)
    a = dt.new_zeros(b, chunks * q, h, dtype=torch.float64)  # contiguous, whatever dt's strides
    a[:, :length] = dt.float() * A.float()
    return a.view(b, chunks, q, h).cumsum_(dim=2).view(b, chunks * q, h), chunks


def _total(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t.sum(dim)`` added in index order, however large the other dims (``dim`` not the last)."""
    return t.cumsum(dim=dim).select(dim, -1)


def _shapes(x, B, chunk_size):
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    q = min(int(chunk_size), length)
    return b, length, h, p, g, n, q


def _skip_weights(D: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """``D`` as ``[heads, p]`` float32 (a per-head ``D`` broadcast with stride 0), or a dummy."""
    if D is None:
        return x.new_zeros(1, dtype=torch.float32), (0, 0)
    weights = D.float()
    weights = weights.unsqueeze(-1).expand(-1, x.shape[-1]) if weights.dim() == 1 else weights
    return weights, weights.stride()


def _states(x, dt, cum, B, chunks, q, r, blocks) -> torch.Tensor:
    """``[b, chunks, heads, p, n]`` float32: the state entering each chunk (unrounded)."""
    b, length, h, p = x.shape
    n = B.shape[-1]
    states = torch.empty(b, chunks, h, p, n, device=x.device, dtype=torch.float32)
    _launch(
        _chunk_states_kernel, (b * chunks, h),
        x, *x.stride(), dt, *dt.stride(), cum, B, *B.stride(), states,
        length, q, chunks, h, r, p, n, TO_END=True, num_warps=_WARPS, **blocks,
    )  # fmt: skip
    _launch(
        _pass_states_kernel, (b * h, triton.cdiv(p * n, _PASS_BLOCK)),
        states, cum, chunks * q, q, chunks, h, p * n, BLOCK=_PASS_BLOCK,
    )  # fmt: skip
    return states


def _entering_states(x, dt, A, B, chunk_size, rows):
    """What forward and backward both start with: the shapes ``(b, length, h, p, g, n, q)``, ``dt`` in
    float32, the within-chunk sums and the number of chunks, the tile sizes (``rows`` of a chunk per
    program), and the state entering each chunk."""
    shapes = b, length, h, p, g, n, q = _shapes(x, B, chunk_size)
    dt = dt.float()
    cum, chunks = _cumsums(dt, A, q)
    blocks = dict(BQ=min(rows, _pow2(q)), BP=_pow2(p), BN=_pow2(n))
    return shapes, dt, cum, chunks, blocks, _states(x, dt, cum, B, chunks, q, h // g, blocks)


def scan(x, dt, A, B, C, chunk_size, D=None, state_dtype=None, out=None) -> torch.Tensor:
    """``ssd._chunked_scan(x, dt, A, B, C, chunk_size, D, state_dtype=state_dtype)`` (no states in or
    out) on the kernels, written into ``out`` (default: a new tensor like ``x``)."""
    (b, length, h, p, g, n, q), dt, cum, chunks, blocks, states = _entering_states(x, dt, A, B, chunk_size, _BQ_FORWARD)
    out = torch.empty_like(x) if out is None else out
    weights, weight_strides = _skip_weights(D, x)
    _launch(
        _chunk_out_kernel, (b * chunks, h, triton.cdiv(q, blocks["BQ"])),
        x, *x.stride(), dt, *dt.stride(), cum, B, *B.stride(), C, *C.stride(), states,
        weights, *weight_strides, out, *out.stride(),
        length, q, chunks, h, h // g, p, n,
        HAS_D=D is not None, ROUND=_round_code(state_dtype, x.dtype), num_warps=_WARPS, BK=_BK, **blocks,
    )  # fmt: skip
    return out


def scan_grads(x, dt, A, B, C, D, chunk_size, state_dtype, dy, dx=None, dB=None, dC=None) -> tuple:
    """The gradients of :func:`scan` for ``A`` per position ``[b, l, heads]``: ``(dx, ddt, dA, dB,
    dC)``. ``dx``, ``dB``, ``dC`` are written into the given tensors (views are fine; default: new
    ones like the inputs); ``ddt`` and ``dA`` come per position in float32."""
    (b, length, h, p, g, n, q), dt, cum, chunks, blocks, states = _entering_states(
        x, dt, A, B, chunk_size, _BQ_BACKWARD
    )
    r = h // g
    nblocks = triton.cdiv(q, blocks["BQ"])
    round_code = _round_code(state_dtype, x.dtype)
    grads = torch.empty_like(states)  # of the entering states, then in place of the chunks' own states
    _launch(
        _chunk_states_kernel, (b * chunks, h),
        dy, *dy.stride(), dt, *dt.stride(), cum, C, *C.stride(), grads,
        length, q, chunks, h, r, p, n, TO_END=False, num_warps=_WARPS, **blocks,
    )  # fmt: skip
    pass_blocks = triton.cdiv(p * n, _PASS_BLOCK)
    dsum = torch.empty(b, h, pass_blocks, chunks, device=x.device, dtype=torch.float32)
    _launch(
        _pass_states_backward_kernel, (b * h, pass_blocks),
        grads, states, cum, dsum, chunks * q, q, chunks, h, p * n, pass_blocks, ROUND=round_code, BLOCK=_PASS_BLOCK,
    )  # fmt: skip
    dx = torch.empty_like(x) if dx is None else dx
    dB = torch.empty_like(B) if dB is None else dB
    dC = torch.empty_like(C) if dC is None else dC
    ddt, dcum, seg, drow = (torch.empty_like(cum, dtype=torch.float32) for _ in range(4))
    weights, weight_strides = _skip_weights(D, x)
    _launch(
        _backward_columns_kernel, (b * chunks, g, nblocks),
        x, *x.stride(), dt, *dt.stride(), cum, B, *B.stride(), C, *C.stride(), dy, *dy.stride(), grads,
        weights, *weight_strides, dx, *dx.stride(), dB, *dB.stride(), ddt, dcum, seg,
        length, q, chunks, h, r, p, n, nblocks, HAS_D=D is not None, num_warps=_WARPS, BK=_BK, **blocks,
    )  # fmt: skip
    del grads
    _launch(
        _backward_rows_kernel, (b * chunks, g, nblocks),
        x, *x.stride(), dt, *dt.stride(), cum, B, *B.stride(), C, *C.stride(), dy, *dy.stride(), states,
        dC, *dC.stride(), drow, length, q, chunks, h, r, p, n, ROUND=round_code, num_warps=_WARPS, BK=_BK, **blocks,
    )  # fmt: skip
    del states
    # d cum_k = row sums - column sums of the scores (+ the entering state's term) - seg_k; the chunk's
    # last sum also gets sum_j seg_j (through exp(cum_last - cum_j)) and the passing's gradient. Sums
    # over a dim that is not the last are cumulative sums, one element after the other whatever the
    # other dims' sizes (a reduction's order may follow them, and slices of heads must not change a bit).
    extra = _total(seg.view(b, chunks, q, h), dim=2) + _total(dsum, dim=2).transpose(1, 2)
    dcum = dcum.add_(drow).sub_(seg).view(b, chunks, q, h)
    dcum[:, :, -1] += extra
    da = dcum.flip(2).cumsum(dim=2).flip(2).reshape(b, chunks * q, h)[:, :length]  # cum_k sums a_0..a_k
    ddt = ddt[:, :length] + da * A.float()
    return dx, ddt, da * dt, dB, dC
