"""Tests for non-owning tensor views (cuda_graphs/weakref.py).

CPU tests check layout fidelity with ``allow_cpu=True`` while the owner stays
alive (a CPU weak view dangles the moment its owner dies). GPU tests check the
same on CUDA and that dropping the owner really frees the memory.
"""

import warnings

import pytest
import torch

from megatron.core.transformer.cuda_graphs import weak as cg_weakref
from megatron.core.transformer.cuda_graphs.weak import is_weak_ref, make_weak_ref, poison_

_DTYPE_NAMES = [
    "float64", "float32", "float16", "bfloat16",
    "uint8", "int8", "int16", "int32", "int64", "bool",
    "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "uint16", "uint32", "uint64",
]  # fmt: skip
DTYPES = [getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)]
DTYPE_IDS = [str(d).replace("torch.", "") for d in DTYPES]

# (name, function from a contiguous (6, 8) base to the tensor under test)
LAYOUTS = [
    ("contiguous", lambda b: b),
    ("transposed", lambda b: b.t()),  # strides (1, 8)
    ("offset_slice", lambda b: b[2:5, 3:7]),  # storage_offset 19, strides (8, 1)
    ("stepped_1d", lambda b: b.view(-1)[5::3]),  # storage_offset 5, stride 3
]
LAYOUT_IDS = [name for name, _ in LAYOUTS]


def _values(shape, dtype, seed=0):
    """Deterministic, NaN-free values of any dtype (on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.complex64).to(dtype)
    if dtype.is_floating_point:
        # Positive and away from zero: representable even in float8_e8m0fnu.
        return (torch.rand(shape, generator=g) * 4 + 0.25).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _bytes(t):
    """The element bytes of ``t`` in logical order (works for every dtype)."""
    return t.cpu().contiguous().view(torch.uint8)


def _assert_same_view(weak, orig):
    assert weak is not orig
    assert is_weak_ref(weak)
    assert weak.data_ptr() == orig.data_ptr()
    assert weak.dtype == orig.dtype
    assert weak.device == orig.device
    assert weak.shape == orig.shape
    assert weak.stride() == orig.stride()
    assert weak.storage_offset() == orig.storage_offset()
    # The storage starts at the original storage's base and spans all of it.
    assert weak.untyped_storage().data_ptr() == orig.untyped_storage().data_ptr()
    assert weak.untyped_storage().nbytes() == orig.untyped_storage().nbytes()
    assert torch.equal(_bytes(weak), _bytes(orig))


# --------------------------------------------------------------------- CPU


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cpu_weak_ref_keeps_layout_and_aliases(dtype, layout):
    base = _values((6, 8), dtype)
    orig = layout[1](base)
    weak = make_weak_ref(orig, allow_cpu=True)
    _assert_same_view(weak, orig)
    assert not weak.requires_grad

    # Writes through the weak view land in the original ...
    new = _values(tuple(orig.shape), dtype, seed=1)
    assert not torch.equal(_bytes(new), _bytes(orig))
    weak.copy_(new)
    assert torch.equal(_bytes(orig), _bytes(new))
    # ... and writes to the original show through the weak view.
    newer = _values(tuple(orig.shape), dtype, seed=2)
    orig.copy_(newer)
    assert torch.equal(_bytes(weak), _bytes(newer))


def test_cpu_weak_ref_of_broadcast_view():
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    orig = base[:, 2:3].expand(6, 5)  # stride (8, 0)
    weak = make_weak_ref(orig, allow_cpu=True)
    _assert_same_view(weak, orig)
    assert weak.stride() == (8, 0)


def test_cpu_weak_ref_keeps_conj_and_neg_bits():
    z = torch.randn(5, dtype=torch.complex64)
    conj = z.conj()
    assert conj.is_conj()
    weak = make_weak_ref(conj, allow_cpu=True)
    assert weak.is_conj() and is_weak_ref(weak)
    assert weak.data_ptr() == conj.data_ptr()
    assert torch.equal(weak, conj)

    neg = z.conj().imag  # a negative-bit view of the imaginary parts
    assert neg.is_neg()
    weak = make_weak_ref(neg, allow_cpu=True)
    assert weak.is_neg() and is_weak_ref(weak)
    assert torch.equal(weak, neg)


def test_cpu_weak_ref_does_not_own_storage():
    StorageWeakRef = pytest.importorskip("torch.multiprocessing.reductions").StorageWeakRef
    owner = torch.ones(1024)
    probe = StorageWeakRef(owner.untyped_storage())
    weak = make_weak_ref(owner, allow_cpu=True)
    strong_view = owner[1:]  # a real view keeps the storage alive
    del owner
    assert not probe.expired()
    del strong_view
    # Only the weak view is left and it does not keep the storage alive.
    # (Its memory is gone now: never read it.)
    assert probe.expired()
    assert is_weak_ref(weak)


def test_cpu_weak_ref_of_empty_tensor():
    orig = torch.empty(0, 3, dtype=torch.float16)
    weak = make_weak_ref(orig, allow_cpu=True)
    assert is_weak_ref(weak)
    assert weak.shape == (0, 3) and weak.dtype == torch.float16


def test_cpu_refused_by_default():
    t = torch.ones(4)
    assert make_weak_ref(t) is t
    assert not is_weak_ref(t)


def test_non_strided_and_meta_are_returned_as_is():
    sparse = torch.eye(3).to_sparse()
    assert make_weak_ref(sparse, allow_cpu=True) is sparse
    meta = torch.empty(4, device="meta")
    assert make_weak_ref(meta, allow_cpu=True) is meta
    assert not is_weak_ref(sparse) and not is_weak_ref(meta)


def test_weak_ref_of_weak_ref_is_itself_and_type_checks():
    t = torch.ones(4)
    weak = make_weak_ref(t, allow_cpu=True)
    assert make_weak_ref(weak, allow_cpu=True) is weak
    assert not is_weak_ref("not a tensor")
    with pytest.raises(TypeError, match="torch.Tensor"):
        make_weak_ref([1, 2, 3])


def _raise(*args, **kwargs):
    raise RuntimeError("simulated failure")


@pytest.mark.parametrize("how", ["raises", "missing"])
def test_fallback_returns_strong_ref_and_warns_once(monkeypatch, how):
    monkeypatch.setattr(cg_weakref, "_fallback_warned", False)
    if how == "raises":
        monkeypatch.setattr(torch._C, "_construct_storage_from_data_pointer", _raise)
    else:
        monkeypatch.delattr(torch._C, "_construct_storage_from_data_pointer")
    a, b = torch.ones(3), torch.zeros(5, dtype=torch.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ra = make_weak_ref(a, allow_cpu=True)
        rb = make_weak_ref(b, allow_cpu=True)
    assert ra is a and rb is b
    assert not is_weak_ref(ra) and not is_weak_ref(rb)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "will not be released" in msgs[0]


def test_fallback_recovers_when_api_works_again(monkeypatch):
    monkeypatch.setattr(cg_weakref, "_fallback_warned", False)
    with monkeypatch.context() as m:
        m.setattr(torch._C, "_construct_storage_from_data_pointer", _raise)
        with pytest.warns(RuntimeWarning):
            assert not is_weak_ref(make_weak_ref(torch.ones(2), allow_cpu=True))
    assert is_weak_ref(make_weak_ref(torch.ones(2), allow_cpu=True))


def _assert_poisoned(x):
    dtype = x.dtype
    if dtype == torch.bool:
        assert bool(x.all())
    elif dtype.is_floating_point or dtype.is_complex:
        assert bool(torch.isnan(x).all())
    else:
        # Integer max, checked on the bytes, independently of fill_.
        itemsize = x.element_size()
        pattern = torch.iinfo(dtype).max.to_bytes(itemsize, "little", signed=dtype.is_signed)
        rows = _bytes(x).reshape(-1, itemsize)
        assert torch.equal(rows, torch.tensor(list(pattern), dtype=torch.uint8).expand_as(rows))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_poison_every_dtype(dtype):
    base = torch.zeros(6, 8, dtype=dtype)
    assert poison_(base[:, ::2]) is not None
    _assert_poisoned(base[:, ::2])
    # Elements outside the view are untouched.
    assert not _bytes(base[:, 1::2]).any()


def test_poison_weak_view_writes_the_original():
    orig = torch.zeros(4, 4, dtype=torch.bfloat16)
    poison_(make_weak_ref(orig.t(), allow_cpu=True))
    assert bool(torch.isnan(orig).all())


def test_poison_nan_free_packed_dtype_uses_all_ones_bytes():
    dtype = getattr(torch, "float4_e2m1fn_x2", None)
    if dtype is None:
        pytest.skip("torch has no float4_e2m1fn_x2")
    x = torch.zeros(8, dtype=torch.uint8).view(dtype)
    poison_(x)
    assert bool((x.view(torch.uint8) == 0xFF).all())


# --------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_weak_ref_keeps_layout_and_aliases(dtype, layout):
    base = _values((6, 8), dtype).cuda()
    orig = layout[1](base)
    weak = make_weak_ref(orig)  # CUDA: weak by default
    _assert_same_view(weak, orig)

    new = _values(tuple(orig.shape), dtype, seed=1).cuda()
    weak.copy_(new)
    assert torch.equal(_bytes(orig), _bytes(new))


@pytest.mark.gpu
def test_cuda_weak_ref_releases_memory_and_keeps_address():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    owner = torch.full((1 << 20,), 7.0, device="cuda")  # 4 MiB
    ptr = owner.data_ptr()
    assert torch.cuda.memory_allocated() - before == owner.nbytes
    weak = make_weak_ref(owner[256:])
    assert weak.data_ptr() == ptr + 256 * 4 and weak.storage_offset() == 256
    assert float(weak[0]) == 7.0
    del owner
    # The block went back to the caching allocator; the weak view did not keep it.
    assert torch.cuda.memory_allocated() == before
    assert weak.data_ptr() == ptr + 256 * 4
    assert is_weak_ref(weak)
    del weak


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_poison_every_dtype(dtype):
    base = torch.zeros(6, 8, dtype=dtype, device="cuda")
    poison_(base[:, ::2])
    _assert_poisoned(base[:, ::2])
    assert not _bytes(base[:, 1::2]).any()
