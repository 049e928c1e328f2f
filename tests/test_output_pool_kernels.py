"""Every native CPU kernel's large outputs come from the one output pool (csrc/output_pool.h), bit-exact.

For each kernel (forward and backward, integer / affine / E4M3 / E5M2 / E2M1 / NVFP4 / MX), each input layout and
dtype (float32 contiguous, float16 strided, bfloat16 contiguous) and both kernel implementations (AVX2 and scalar):
an output still held is never handed out again and stays unchanged while the kernel runs again; a released output's
memory is reused, and the results over its stale bytes equal the pure-torch reference (torch.equal) as a fresh
output does. Also: one block serves outputs of other dtypes of the same byte size, other sizes do not take it, the
pooled storages are resizable, and many threads at once never share live memory.
"""

from __future__ import annotations

import threading

import pytest
import torch

from modelopt_lite.functional import library_block
from modelopt_lite.functional import library_minifloat as lm
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.functional import reference as R

MIB = 1 << 20
COLS = 2048
ROWS = {torch.float32: 512, torch.float16: 1024, torch.bfloat16: 1024}  # 4 MiB outputs: the smallest pooled size
S = torch.tensor(0.25)  # x / s hits exact .5 ties for x on the 1/8 grid
S_COLS = (torch.rand(1, COLS, generator=torch.Generator().manual_seed(9)) + 0.05).float()
ZP = torch.full((1, COLS), 3.0)

# name -> (native call, reference call); each takes (x, g) and returns a tuple of tensors
OPS = {
    "fake_quant_int": (lambda n, x, g: (n.fake_quant_int(x, S, -8, 7),), lambda x, g: (R.fake_quant_int(x, S, -8, 7),)),
    "quantize_int": (
        lambda n, x, g: (n.quantize_int(x, S, -128, 127),),
        lambda x, g: (R.quantize_int(x, S, -128, 127),),
    ),
    "fake_quant_int_cols": (
        lambda n, x, g: (n.fake_quant_int(x, S_COLS, -128, 127),),
        lambda x, g: (R.fake_quant_int(x, S_COLS, -128, 127),),
    ),
    "fake_e4m3": (lambda n, x, g: (n.fake_e4m3(x, S),), lambda x, g: (R.fake_e4m3(x, S),)),
    "fake_e5m2": (lambda n, x, g: (n.fake_e5m2(x, S),), lambda x, g: (lm.fake_e5m2_reference(x, S),)),
    "fake_e2m1": (lambda n, x, g: (n.fake_e2m1(x, S),), lambda x, g: (lm.fake_e2m1_reference(x, S),)),
    "fake_affine": (
        lambda n, x, g: (n.fake_affine(x, S_COLS, ZP, -128, 127),),
        lambda x, g: (R.fake_affine(x, S_COLS, ZP, -128, 127),),
    ),
    "quantize_affine": (
        lambda n, x, g: (n.quantize_affine(x, S_COLS, ZP, -128, 127),),
        lambda x, g: (R.quantize_affine(x, S_COLS, ZP, -128, 127),),
    ),
    "int_backward": (
        lambda n, x, g: tuple(n.int_backward(g, x, S, -8, 7, True)),
        lambda x, g: tuple(R.int_backward(g, x, S, -8, 7, True)),
    ),
    "e4m3_backward": (
        lambda n, x, g: tuple(n.e4m3_backward(g, x, S_COLS, True)),
        lambda x, g: tuple(R.e4m3_backward(g, x, S_COLS, True)),
    ),
    "affine_backward": (
        lambda n, x, g: (n.affine_backward(g, x, S_COLS, ZP, -128, 127),),
        lambda x, g: (R.affine_backward(g, x, S_COLS, ZP, -128, 127),),
    ),
    "fake_block_last": (
        lambda n, x, g: (n.fake_block_last(x, None, 128, 0, 7.0, -8, 7)[0],),
        lambda x, g: (library_block._reference(x, None, 128, 0, 7.0, -8, 7)[0],),
    ),
    "fake_mx_e4m3": (lambda n, x, g: (n.fake_mx(x, "e4m3", 32, "floor"),), lambda x, g: (mx.fake_mx(x, "e4m3", 32),)),
    "fake_nvfp4": (
        lambda n, x, g: (n.fake_nvfp4(x, torch.tensor(0.01), 16),),
        lambda x, g: (mx.fake_nvfp4(x, torch.tensor(0.01), 16),),
    ),
}
LAYOUTS = {"fp32": (torch.float32, False), "fp16_strided": (torch.float16, True), "bf16": (torch.bfloat16, False)}


@pytest.fixture
def pool(native):
    native.set_output_pool_limit(None)
    native.release_output_pool()
    yield native
    native.set_output_pool_limit(None)
    native.release_output_pool()


def _data(seed: int, dtype: torch.dtype, strided: bool) -> torch.Tensor:
    """Values on the 1/8 grid (ties of x / 0.25) and beyond the int4/int8 grids' ends, in dtype and layout."""
    g = torch.Generator().manual_seed(seed)
    shape = (COLS, ROWS[dtype]) if strided else (ROWS[dtype], COLS)
    x = torch.round(torch.randn(shape, generator=g) * 80) / 8
    x = x.to(dtype)
    return x.t() if strided else x


def _ptrs(ts) -> list[int]:
    return [t.untyped_storage().data_ptr() for t in ts]


def _equal(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), (what, a.dtype, b.dtype, a.shape)
        assert torch.equal(a, b), f"{what}: differs from the reference at {(a != b).nonzero()[:3].tolist()}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("op", sorted(OPS))
def test_held_outputs_are_kept_and_reused_outputs_are_exact(pool, impl, op, layout):
    run, ref = OPS[op]
    dtype, strided = LAYOUTS[layout]
    a, b = _data(1, dtype, strided), _data(2, dtype, strided)
    g = _data(3, dtype, False)
    want = ref(b, g)
    y1 = run(pool, a, g)  # fresh memory
    keep = [t.clone() for t in y1]
    y2 = run(pool, b, g)  # y1 still held: never its memory
    assert not set(_ptrs(y1)) & set(_ptrs(y2))
    _equal(y1, keep, f"{op}: a held output changed")
    _equal(y2, want, f"{op} fresh")
    released = set(_ptrs(y2))
    hits = pool.output_pool_stats()[3]
    del y2
    y3 = run(pool, b, g)  # over the stale bytes of y2's released memory
    assert set(_ptrs(y3)) == released and pool.output_pool_stats()[3] == hits + len(released)
    _equal(y3, want, f"{op} reused")
    _equal(y1, keep, f"{op}: a held output changed")


def test_one_block_serves_other_dtypes_of_its_size_only(pool):
    x32 = torch.cat([_data(4, torch.float32, False)] * 2)
    y = pool.fake_quant_int(x32, S, -128, 127)  # 8 MiB
    ptr = y.data_ptr()
    del y
    xb = torch.cat([x32, x32]).to(torch.bfloat16)  # 2x the elements at 2 bytes: the same 8 MiB
    yb = pool.fake_e4m3(xb, S)
    assert yb.data_ptr() == ptr and torch.equal(yb, R.fake_e4m3(xb, S))
    del yb
    y_other = pool.fake_quant_int(x32[:768], S, -128, 127)  # 6 MiB: a new block, the 8 MiB one stays kept
    assert y_other.data_ptr() != ptr and pool.output_pool_stats()[:2] == (8 * MIB, 1)
    assert torch.equal(y_other, R.fake_quant_int(x32[:768], S, -128, 127))


def test_pooled_storage_is_resizable_and_pool_off_is_exact(pool):
    x = _data(5, torch.float32, False)
    y = pool.fake_quant_int(x, S, -8, 7)
    want = R.fake_quant_int(x, S, -8, 7)
    y.resize_(x.shape[0] * 2, COLS)  # a storage of the pool's allocator grows like any other
    assert torch.equal(y[: x.shape[0]], want)
    del y
    pool.set_output_pool_limit(0)
    y = pool.int_backward(x, x, S, -8, 7, True)
    assert pool.output_pool_stats()[:3] == (0, 0, 0)
    _equal(tuple(y), tuple(R.int_backward(x, x, S, -8, 7, True)), "pool off")


def test_many_threads_never_share_live_memory(pool):
    jobs = [
        ("fake_quant_int", "fp32"),
        ("fake_e4m3", "bf16"),
        ("int_backward", "fp16_strided"),
        ("fake_mx_e4m3", "fp32"),
    ]
    inputs = {}
    for i, (op, layout) in enumerate(jobs):
        dtype, strided = LAYOUTS[layout]
        x, g = _data(10 + i, dtype, strided), _data(20 + i, dtype, False)
        inputs[op] = (x, g, OPS[op][1](x, g))
    held: list[tuple[str, tuple]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            mine: list[tuple[str, tuple]] = []
            for it in range(6):
                op = jobs[(k + it) % len(jobs)][0]
                x, g, want = inputs[op]
                y = OPS[op][0](pool, x, g)
                _equal(y, want, f"thread {k} {op}")
                mine.append((op, y))
                if len(mine) > 2:
                    mine.pop(0)  # released: its memory goes back to the pool while other threads run
            with lock:
                held.extend(mine)
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    spans = []
    for op, y in held:  # every output still held: unchanged, and no two share a byte
        _equal(y, inputs[op][2], f"held {op}")
        spans += [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in y]
    spans.sort()
    assert all(p0 + n0 <= p1 for (p0, n0), (p1, _) in zip(spans, spans[1:]))
    assert pool.output_pool_stats()[3] > 0  # the threads did reuse released memory
