"""TorchScript-exporter symbolics: each ``torch.ops.modelopt_lite`` fake-quant op becomes one *marker* node.

A marker is a node of the private domain ``modelopt_lite`` that keeps the op's inputs (x, scale[, zero_point]) and its
integer range and x's element type (``dtype``) as attributes; its output has x's type and shape. It never reaches
the saved file: after export, :mod:`.postprocess` replaces every marker with standard
``QuantizeLinear``/``DequantizeLinear`` (activations) or integer/FP8 initializers followed by ``DequantizeLinear``
(weights), once the scales are known constants. For a float16/bfloat16 ``x`` the post-pass adds the casts to and
from float32 around the Q/DQ (the numerics contract computes in float32): casts appear only where needed.

Markers (domain ``modelopt_lite``, version 1):

- ``FakeQuantInt(x, scale) {qmin, qmax, dtype}``  ->  ``clamp(rint(x / scale), qmin, qmax) * scale``
- ``FakeE4M3(x, scale) {dtype}``                  ->  ``e4m3(clamp(x / scale, -448, 448)) * scale``
- ``FakeE5M2(x, scale) {dtype}``, ``FakeE2M1(x, scale) {dtype}``: the same with E5M2 (57344) / E2M1 (6)
- ``FakeAffine(x, scale, zero_point) {qmin, qmax, dtype}``
- ``FakeNVFP4(x, global_scale) {block, dtype}``  ->  NVFP4 (see :mod:`modelopt_lite.functional.microscaling`)
- ``FakeNVFP4Static(x, global_scale, block_amax) {block, dtype}``  ->  static NVFP4 (stored block amaxes)
- ``FakeMX(x) {elem, block, rounding, dtype}``    ->  OCP MX with element ``elem`` (a string attribute)
"""

from __future__ import annotations

import contextlib

#: Domain of the marker nodes (never present in a finished export).
DOMAIN = "modelopt_lite"
INT_MARKER = "FakeQuantInt"
E4M3_MARKER = "FakeE4M3"
AFFINE_MARKER = "FakeAffine"
NVFP4_MARKER = "FakeNVFP4"
NVFP4_STATIC_MARKER = "FakeNVFP4Static"
MX_MARKER = "FakeMX"
E5M2_MARKER = "FakeE5M2"
E2M1_MARKER = "FakeE2M1"
#: markers of the float32-scaled float formats -> their ``num_bits`` (``formats.element_format`` owns the rest)
FLOAT_MARKERS = {E4M3_MARKER: (4, 3), E5M2_MARKER: (5, 2), E2M1_MARKER: (2, 1)}
MARKERS = (INT_MARKER, AFFINE_MARKER, NVFP4_MARKER, NVFP4_STATIC_MARKER, MX_MARKER, *FLOAT_MARKERS)
#: markers of block formats whose scales the post-pass computes itself (see :mod:`.microscaling`)
MICROSCALING_MARKERS = (NVFP4_MARKER, NVFP4_STATIC_MARKER, MX_MARKER)

#: ``torch.ops.modelopt_lite`` op name -> marker op type.
OP_TO_MARKER = {
    "fake_quant_int": INT_MARKER,
    "fake_e4m3": E4M3_MARKER,
    "fake_affine": AFFINE_MARKER,
    "fake_nvfp4": NVFP4_MARKER,
    "fake_nvfp4_static": NVFP4_STATIC_MARKER,
    "fake_mx": MX_MARKER,
    "fake_e5m2": E5M2_MARKER,
    "fake_e2m1": E2M1_MARKER,
}

# ONNX TensorProto element types used by the casts around markers.
_FLOAT, _FLOAT16, _BFLOAT16 = 1, 10, 16
_TS_TO_ONNX = {"Float": _FLOAT, "Half": _FLOAT16, "BFloat16": _BFLOAT16}
#: opset the symbolics are registered for (they are valid for every later opset too)
_REGISTER_OPSET = 13


def _onnx_dtype(value) -> int:
    """ONNX element type of a TorchScript graph value (float32 when unknown)."""
    try:
        name = value.type().scalarType()
    except RuntimeError:
        return _FLOAT
    if name is None:
        return _FLOAT
    if name not in _TS_TO_ONNX:
        raise TypeError(
            f"modelopt_lite ONNX export: fake quantization of a {name} tensor is not supported "
            "(float32, float16 or bfloat16 only)"
        )
    return _TS_TO_ONNX[name]


def _wrap(g, x, build):
    """Call ``build(dtype)`` (the marker, told x's element type) and give its output x's type and shape."""
    out = build(_onnx_dtype(x))
    try:
        out.setType(x.type())
    except RuntimeError:  # pragma: no cover - type unavailable
        pass
    return out


def _const_int(g_value, what: str) -> int:
    from torch.onnx import symbolic_helper

    v = symbolic_helper._maybe_get_const(g_value, "i")
    if not isinstance(v, int):
        raise TypeError(f"modelopt_lite ONNX export: {what} must be a Python int constant, got {v!r}")
    return v


def _sym_fake_quant_int(g, x, scale, qmin, qmax):
    lo, hi = _const_int(qmin, "qmin"), _const_int(qmax, "qmax")
    return _wrap(g, x, lambda dt: g.op(f"{DOMAIN}::{INT_MARKER}", x, scale, qmin_i=lo, qmax_i=hi, dtype_i=dt))


def _sym_float(marker: str):
    def sym(g, x, scale):
        return _wrap(g, x, lambda dt: g.op(f"{DOMAIN}::{marker}", x, scale, dtype_i=dt))

    return sym


_sym_fake_e4m3 = _sym_float(E4M3_MARKER)


def _sym_fake_affine(g, x, scale, zero_point, qmin, qmax):
    lo, hi = _const_int(qmin, "qmin"), _const_int(qmax, "qmax")
    return _wrap(
        g, x, lambda dt: g.op(f"{DOMAIN}::{AFFINE_MARKER}", x, scale, zero_point, qmin_i=lo, qmax_i=hi, dtype_i=dt)
    )


def _const_str(g_value, what: str) -> str:
    from torch.onnx import symbolic_helper

    v = symbolic_helper._maybe_get_const(g_value, "s")
    if not isinstance(v, str):
        raise TypeError(f"modelopt_lite ONNX export: {what} must be a Python str constant, got {v!r}")
    return v


def _sym_fake_nvfp4(g, x, global_scale, block):
    b = _const_int(block, "block")
    return _wrap(g, x, lambda dt: g.op(f"{DOMAIN}::{NVFP4_MARKER}", x, global_scale, block_i=b, dtype_i=dt))


def _sym_fake_nvfp4_static(g, x, global_scale, block_amax, block):
    b = _const_int(block, "block")
    marker = f"{DOMAIN}::{NVFP4_STATIC_MARKER}"
    return _wrap(g, x, lambda dt: g.op(marker, x, global_scale, block_amax, block_i=b, dtype_i=dt))


def _sym_fake_mx(g, x, elem, block, rounding):
    e, b, r = _const_str(elem, "elem"), _const_int(block, "block"), _const_str(rounding, "rounding")
    return _wrap(g, x, lambda dt: g.op(f"{DOMAIN}::{MX_MARKER}", x, elem_s=e, block_i=b, rounding_s=r, dtype_i=dt))


_SYMBOLICS = {
    "fake_quant_int": _sym_fake_quant_int,
    "fake_e4m3": _sym_fake_e4m3,
    "fake_affine": _sym_fake_affine,
    "fake_nvfp4": _sym_fake_nvfp4,
    "fake_nvfp4_static": _sym_fake_nvfp4_static,
    "fake_mx": _sym_fake_mx,
    "fake_e5m2": _sym_float(E5M2_MARKER),
    "fake_e2m1": _sym_float(E2M1_MARKER),
}


@contextlib.contextmanager
def registered_symbolics():
    """Register the marker symbolics with the TorchScript exporter for the duration of a block.

    They are unregistered afterwards, so no exporter state outlives an :func:`export_onnx` call.
    """
    import torch
    import torch.onnx

    from ..functional import (  # noqa: F401  (define torch.ops.modelopt_lite.*)
        library,
        library_minifloat,
        library_mx,
        library_nvfp4_static,
    )

    names = []
    try:
        for op, fn in _SYMBOLICS.items():
            name = f"{DOMAIN}::{op}"
            torch.onnx.register_custom_op_symbolic(name, fn, _REGISTER_OPSET)
            names.append(name)
        yield
    finally:
        for name in names:
            torch.onnx.unregister_custom_op_symbolic(name, _REGISTER_OPSET)
