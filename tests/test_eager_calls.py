"""functional/eager.py: plain eager calls run an op's body (and its autograd) without the dispatcher's Python layers,
with the op's values and gradients bit for bit; every other context keeps the op."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames as Passthrough  # a dispatch mode that changes nothing: forces the op path

from modelopt_lite.functional import (
    eager,
    library,
    library_block,
    library_block_cuda,
    library_minifloat,
    library_mx,
    library_nvfp4_static,
)
from modelopt_lite.functional import microscaling as ms


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def _scale(v=0.05):
    return torch.tensor(v)


#: name -> (op, args maker (fresh tensors), indices of the differentiable tensor args)
CASES = {
    "fake_quant_int": (library.fake_quant_int.op, lambda: (_x(6, 64), _scale(), -128, 127), (0, 1)),
    "quantize_int": (library.quantize_int, lambda: (_x(6, 64), _scale(), -8, 7), (0,)),
    "fake_quant_uint": (library.fake_quant_uint, lambda: (_x(6, 64).abs(), _scale(), 0, 255), (0, 1)),
    "fake_e4m3": (library.fake_e4m3.op, lambda: (_x(6, 64), _scale(0.01)), (0, 1)),
    "fake_affine": (
        library.fake_affine.op,
        lambda: (_x(6, 64), _scale(), torch.tensor(3.0), -128, 127),
        (0,),
    ),
    "fake_e5m2": (library_minifloat.fake_e5m2.op, lambda: (_x(6, 64), _scale(0.001)), (0, 1)),
    "fake_e2m1": (library_minifloat.fake_e2m1.op, lambda: (_x(6, 64), _scale(1.0)), (0, 1)),
    "fake_mx": (library_mx.fake_mx, lambda: (_x(6, 64), "e4m3", 32, "floor"), (0,)),
    "fake_nvfp4": (library_mx.fake_nvfp4, lambda: (_x(6, 64), ms.nvfp4_global_scale(torch.tensor(5.0)), 16), (0,)),
    "fake_nvfp4_amax": (library_mx.fake_nvfp4_amax, lambda: (_x(6, 64), torch.tensor(5.0), 16), (0,)),
    "fake_nvfp4_static": (
        library_nvfp4_static.fake_nvfp4_static,
        lambda: (
            _x(6, 64),
            ms.nvfp4_global_scale(torch.tensor(9.0)),
            torch.full((6, 4), 2.0),
            16,
        ),
        (0,),
    ),
    "fake_block_dynamic": (
        library_block_cuda.fake_block_dynamic,
        lambda: (_x(6, 64), 16, 7.0, -8, 7, False, 0, 0.0, 0),
        (0,),
    ),
    "fake_block_static": (
        library_block_cuda.fake_block_static,
        lambda: (_x(6, 64), torch.linspace(0.5, 9.0, 24).reshape(6, 4), 16, 7.0, -8, 7, False),
        (0,),
    ),
    "fake_block_last": (library_block.fake_block_last, lambda: (_x(6, 64), None, 16, 0, 7.0, -8, 7), (0,)),
}


def _run(op, args, grads):
    """Output(s) and the gradients of a fixed upstream gradient w.r.t. the tensors at ``grads``."""
    args = tuple(a.clone().requires_grad_() if i in grads else a for i, a in enumerate(args))
    out = eager.call(op, *args)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
    return out, tuple(args[i].grad for i in grads), y.grad_fn


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a is None and b is None or torch.equal(a, b)


@pytest.mark.parametrize("name", list(CASES))
def test_direct_path_equals_the_op(name):
    op, make, grads = CASES[name]
    out, g, fn = _run(op, make(), grads)
    assert type(fn).__name__.endswith("EagerBackward"), type(fn).__name__  # the direct path ran
    with Passthrough() as mode:
        want, want_g, want_fn = _run(op, make(), grads)
    assert op._name in mode.ops  # the op path ran
    assert not type(want_fn).__name__.endswith("EagerBackward")
    assert _same(out, want) and _same(g, want_g)
    assert all(t is not None for t in g)  # the scale gradients too (ctx.needs_input_grad lines up)
    with torch.no_grad():  # the body alone
        assert _same(eager.call(op, *make()), want)


def test_contexts_that_keep_the_op():
    x = _x(4, 32)
    assert eager.plain_eager((x, 3, "e4m3"))
    with Passthrough():
        assert not eager.plain_eager((x,))
    with torch.device("cpu"):  # a TorchFunctionMode
        assert not eager.plain_eager((x,))
    with torch.profiler.profile():
        assert not eager.plain_eager((x,))
    assert eager.plain_eager((torch.nn.Parameter(x),))
    seen = []
    torch.jit.trace(lambda t: seen.append(eager.plain_eager((t,))) or t * 2, (x,), check_trace=False)
    torch.func.vmap(lambda t: seen.append(eager.plain_eager((t,))) or t * 2)(x)
    assert seen == [False, False]


class _Sub(torch.Tensor):
    pass


def test_subclass_keeps_the_op():
    assert not eager.plain_eager((_x(4, 32).as_subclass(_Sub),))


def test_vmap_and_profiler_run_the_op_with_the_same_values():
    x = _x(5, 64)
    want = eager.call(library_mx.fake_mx, x, "e2m1", 32, "rceil")
    got = torch.func.vmap(lambda r: library_mx.mx_fake_quant(r, "e2m1", 32, "rceil"))(x)
    assert torch.equal(got, want)
    with torch.profiler.profile() as prof:
        library_mx.mx_fake_quant(x, "e2m1", 32, "rceil")
    assert any(e.name == "modelopt_lite::fake_mx" for e in prof.events())  # profiles name the op


def test_compiled_graph_keeps_the_op():
    x = _x(4, 64)
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    f = torch.compile(lambda t: library_mx.mx_fake_quant(t, "e4m3"), backend=backend, fullgraph=True)
    assert torch.equal(f(x), library_mx.mx_fake_quant(x, "e4m3"))
    assert any("fake_mx" in s for s in seen), seen


def test_a_callable_that_is_not_an_op_is_called():
    seen = []
    assert eager.call(lambda *a: seen.append(a) or 7, _x(2, 2), 3) == 7 and seen[0][1] == 3


@pytest.mark.parametrize(
    "desc",
    [
        dict(num_bits=8, amax=2.0),
        dict(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
        dict(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}, amax=3.0),
        dict(num_bits=4, block_sizes={-1: 16, "type": "dynamic"}),
    ],
)
def test_autocast_and_inference_mode_give_the_ops_values(desc):
    from modelopt_lite.descriptor import QuantDescriptor
    from modelopt_lite.nn import TensorQuantizer

    q, x = TensorQuantizer(QuantDescriptor(**desc)), _x(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct = q(x)
        with Passthrough():
            via_op = q(x)
    with torch.inference_mode():
        inference = q(x)
    assert direct.dtype == via_op.dtype == inference.dtype == torch.float32
    assert torch.equal(direct, via_op) and torch.equal(direct, inference)


@pytest.mark.parametrize("name", ["fake_block_dynamic", "fake_block_static"])
def test_block_ops_pass_opcheck(name):
    """Schema, fake (meta) kernel, autograd registration and dispatch of the fused block ops (their reference path
    here), torch.library's own checks."""
    op, make, _ = CASES[name]
    args = make()
    torch.library.opcheck(op, args)
    x = args[0].clone().requires_grad_()
    torch.library.opcheck(op, (x, *args[1:]))
