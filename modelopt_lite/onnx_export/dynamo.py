"""Translations for the dynamo (``torch.export``-based) exporter: the same marker nodes as :mod:`.symbolic`.

``torch.onnx.export(..., dynamo=True, custom_translation_table=translation_table())`` maps each
``torch.ops.modelopt_lite`` fake-quant op to an onnxscript call of the marker op. The marker schemas are built as
local :class:`onnx.defs.OpSchema` objects (never registered globally), which is all onnxscript needs to trace the
call. As in the TorchScript path, the marker records x's element type (``dtype``) for the post-pass.
"""

from __future__ import annotations

import functools

from .symbolic import (
    AFFINE_MARKER,
    DOMAIN,
    E2M1_MARKER,
    E4M3_MARKER,
    E5M2_MARKER,
    INT_MARKER,
    MX_MARKER,
    NVFP4_MARKER,
    NVFP4_STATIC_MARKER,
)

_FLOAT = 1


@functools.lru_cache(maxsize=1)
def _marker_ops():
    from onnx.defs import OpSchema
    from onnxscript.values import Op, Opset

    opset = Opset(DOMAIN, 1)
    param = OpSchema.FormalParameter
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]

    def schema(name, inputs, attrs, strings=()):
        return OpSchema(
            name,
            DOMAIN,
            1,
            inputs=[param(n, t) for n, t in inputs],
            outputs=[param("y", "T")],
            type_constraints=[("T", floats, "float input")],
            attributes=[OpSchema.Attribute(a, OpSchema.AttrType.INT, a) for a in attrs + ("dtype",)]
            + [OpSchema.Attribute(a, OpSchema.AttrType.STRING, a) for a in strings],
        )

    int_in = [("x", "T"), ("scale", "tensor(float)")]
    return {
        INT_MARKER: Op(opset, INT_MARKER, schema(INT_MARKER, int_in, ("qmin", "qmax"))),
        **{m: Op(opset, m, schema(m, int_in, ())) for m in (E4M3_MARKER, E5M2_MARKER, E2M1_MARKER)},
        AFFINE_MARKER: Op(
            opset, AFFINE_MARKER, schema(AFFINE_MARKER, int_in + [("zero_point", "tensor(float)")], ("qmin", "qmax"))
        ),
        NVFP4_MARKER: Op(
            opset, NVFP4_MARKER, schema(NVFP4_MARKER, [("x", "T"), ("global_scale", "tensor(float)")], ("block",))
        ),
        NVFP4_STATIC_MARKER: Op(
            opset,
            NVFP4_STATIC_MARKER,
            schema(
                NVFP4_STATIC_MARKER,
                [("x", "T"), ("global_scale", "tensor(float)"), ("block_amax", "tensor(float)")],
                ("block",),
            ),
        ),
        MX_MARKER: Op(opset, MX_MARKER, schema(MX_MARKER, [("x", "T")], ("block",), ("elem", "rounding"))),
    }


def _dtype(x) -> int:
    dtype = getattr(x, "dtype", None)
    return int(dtype) if dtype is not None else _FLOAT


def _fake_quant_int(x, scale, qmin: int, qmax: int):
    return _marker_ops()[INT_MARKER](x, scale, qmin=qmin, qmax=qmax, dtype=_dtype(x))


def _fake_e4m3(x, scale):
    return _marker_ops()[E4M3_MARKER](x, scale, dtype=_dtype(x))


def _fake_e5m2(x, scale):
    return _marker_ops()[E5M2_MARKER](x, scale, dtype=_dtype(x))


def _fake_e2m1(x, scale):
    return _marker_ops()[E2M1_MARKER](x, scale, dtype=_dtype(x))


def _fake_affine(x, scale, zero_point, qmin: int, qmax: int):
    return _marker_ops()[AFFINE_MARKER](x, scale, zero_point, qmin=qmin, qmax=qmax, dtype=_dtype(x))


def _fake_nvfp4(x, global_scale, block: int):
    return _marker_ops()[NVFP4_MARKER](x, global_scale, block=block, dtype=_dtype(x))


def _fake_nvfp4_static(x, global_scale, block_amax, block: int):
    return _marker_ops()[NVFP4_STATIC_MARKER](x, global_scale, block_amax, block=block, dtype=_dtype(x))


def _fake_mx(x, elem: str, block: int, rounding: str):
    return _marker_ops()[MX_MARKER](x, elem=elem, block=block, rounding=rounding, dtype=_dtype(x))


def translation_table() -> dict:
    """``{torch op overload: onnxscript function}`` for ``torch.onnx.export(custom_translation_table=...)``."""
    import torch

    from ..functional import (  # noqa: F401  (define torch.ops.modelopt_lite.*)
        library,
        library_minifloat,
        library_mx,
        library_nvfp4_static,
    )

    ops = torch.ops.modelopt_lite
    return {
        ops.fake_quant_int.default: _fake_quant_int,
        ops.fake_e4m3.default: _fake_e4m3,
        ops.fake_affine.default: _fake_affine,
        ops.fake_nvfp4.default: _fake_nvfp4,
        ops.fake_nvfp4_static.default: _fake_nvfp4_static,
        ops.fake_mx.default: _fake_mx,
        ops.fake_e5m2.default: _fake_e5m2,
        ops.fake_e2m1.default: _fake_e2m1,
    }
