"""``load_hf_checkpoint``: a unified HF checkpoint (FP8, W4A16 AWQ, NVFP4, NVFP4_SVD) back into real modules.

The checkpoint (:mod:`.hf_export`'s layout, also ModelOpt's own for these formats) is untrusted input: the JSON is
parsed strictly, every tensor is read with safetensors (no pickle), and every key, dtype, shape and value is checked
before the model is touched. The quantized modules become :mod:`modelopt_lite.real` modules (their specs and values
validated by :mod:`modelopt_lite.real.spec_checks`); a W4A16 module with a ``pre_quant_scale`` becomes a
:class:`PreScaledLinear` (the input multiplied by the scale, then the real INT4 module), as the fake-quant module
computes it; an NVFP4_SVD module with SVDQuant factors becomes a :class:`LowRankLinear` (the scaled input through the
real NVFP4 module plus the float branch ``(x_s A^T) B^T``). Every other tensor of the model is loaded bit for bit.

A W4A8_AWQ module becomes an FP8 W8A8 real module: its weight is the E4M3 quantization (``weight_scale_2``) of the
INT4 weight (codes x block ``weight_scale``, in the weight dtype), exactly what the fake-quant SequentialQuantizer
computes, so the weight is bit for bit the fake-quant one; it is stored as E4M3 codes (one byte per weight, not the
checkpoint's half byte: ``modelopt_lite.real`` has no INT4-codes-with-an-FP8-GEMM kernel).

KV-cache scales (``<attention>.k_proj.k_scale`` / ``v_proj.v_scale``, FP8 or NVFP4) make each such attention module
its quantized twin (:mod:`modelopt_lite.nn.modules.quant_attention`) with only ``k_bmm_quantizer`` /
``v_bmm_quantizer`` enabled, as the fake-quant model computes the KV cache (see :mod:`.hf_kv_load`).

Not loadable (ValueError naming the reason): sharded checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..real.fast_gemm import describe, why_not
from ..real.fp8 import static_codes
from ..real.packing import dequantize_weight, pack_int4
from ..real.real_types import build_real_module
from ..real.spec_checks import check_spec, check_values
from .hf_checks import bad as _bad
from .hf_checks import want as _want
from .hf_formats import FP8, KV_FORMATS, NVFP4, NVFP4_SVD, W4A8_AWQ, W4A16_AWQ
from .hf_kv_load import install_kv, kv_plans
from .hf_weights import LORA_KEYS, unpack_int4_rows

WEIGHTS_NAME, QUANT_CONFIG_NAME, CONFIG_NAME = "model.safetensors", "hf_quant_config.json", "config.json"
__all__ = ["LowRankLinear", "PreScaledLinear", "load_hf_checkpoint", "read_hf_checkpoint"]
_LOADABLE = (FP8, NVFP4, NVFP4_SVD, W4A16_AWQ, W4A8_AWQ)
_NVFP4_KEYS = {"weight", "weight_scale", "weight_scale_2", "input_scale"}
_KEYS = {
    FP8: ({"weight", "weight_scale"}, {"input_scale", "bias"}),
    NVFP4: (_NVFP4_KEYS, {"bias"}),
    NVFP4_SVD: (_NVFP4_KEYS, {"bias", "pre_quant_scale", *LORA_KEYS}),
    W4A16_AWQ: ({"weight", "weight_scale"}, {"pre_quant_scale", "bias"}),
    W4A8_AWQ: ({"weight", "weight_scale", "weight_scale_2", "input_scale"}, {"pre_quant_scale", "bias"}),
}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class PreScaledLinear(nn.Module):
    """``inner(x * pre_quant_scale)``: an AWQ weight-only module (the scale is not folded into the INT4 weight)."""

    pre_quant_scale: torch.Tensor

    def __init__(self, inner: nn.Module, in_features: int):
        super().__init__()
        self.inner = inner
        self.register_buffer("pre_quant_scale", torch.ones(in_features, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.pre_quant_scale.to(x.dtype))


class LowRankLinear(PreScaledLinear):
    """``inner(x_s) + (x_s A^T) B^T`` with ``x_s = x * pre_quant_scale``: an SVDQuant layer (the real module holds the
    quantized residual, ``lora_a`` ``(r, in)`` and ``lora_b`` ``(out, r)`` the float branch, in the checkpoint's
    dtype and computed in the input's), as the fake-quant layer adds its branch."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, inner: nn.Module, in_features: int, out_features: int, rank: int, dtype: torch.dtype):
        super().__init__(inner, in_features)
        self.register_buffer("lora_a", torch.zeros(rank, in_features, dtype=dtype))
        self.register_buffer("lora_b", torch.zeros(out_features, rank, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x * self.pre_quant_scale.to(x.dtype)
        low = nn.functional.linear(nn.functional.linear(xs, self.lora_a.to(xs.dtype)), self.lora_b.to(xs.dtype))
        return self.inner(xs) + low


def _no_constants(name: str):
    raise ValueError(f"the JSON literal {name} is not allowed")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"load_hf_checkpoint: {path} is not valid UTF-8 JSON ({e})") from e
    if not isinstance(data, dict):
        raise _bad(path, "top level", f"must be an object, got {type(data).__name__}")
    return data


def _quant_section(folder: Path) -> tuple[Path, dict]:
    p = folder / QUANT_CONFIG_NAME
    if p.is_file():
        q = _read_json(p).get("quantization")
        if not isinstance(q, dict):
            raise _bad(p, "quantization", f"must be an object, got {q!r:.60}")
        return p, q
    p = folder / CONFIG_NAME
    if p.is_file():
        q = _read_json(p).get("quantization_config")
        if isinstance(q, dict) and q.get("quant_method") == "modelopt":
            kv = q.get("kv_cache_scheme")
            kv_algo = FP8 if isinstance(kv, dict) and kv.get("num_bits") == 8 else kv
            return p, {"quant_algo": q.get("quant_algo"), "kv_cache_quant_algo": kv_algo}
    raise FileNotFoundError(f"no {QUANT_CONFIG_NAME} (or a ModelOpt quantization_config in {CONFIG_NAME}) in {folder}")


def _check_quant(path, q: dict) -> str | None:
    algo, kv = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if kv is not None and kv not in KV_FORMATS:
        raise _bad(path, "kv_cache_quant_algo", f"must be one of {list(KV_FORMATS)} or null, got {kv!r}")
    if algo is not None and algo not in _LOADABLE:
        raise _bad(path, "quant_algo", f"must be one of {list(_LOADABLE)} or null, got {algo!r}")
    if "group_size" in q:
        g = q["group_size"]
        ok = isinstance(g, int) and not isinstance(g, bool) and g > 0 and (algo not in (NVFP4, NVFP4_SVD) or g == 16)
        if not ok:
            raise _bad(path, "group_size", f"must be a positive int (16 for NVFP4), got {g!r}")
    ex = q.get("exclude_modules", [])
    if not isinstance(ex, list) or not all(isinstance(s, str) for s in ex):
        raise _bad(path, "exclude_modules", f"must be a list of strings, got {ex!r:.60}")
    return algo


def read_hf_checkpoint(path) -> tuple[str | None, dict[str, torch.Tensor], Path]:
    """``(quant_algo, tensors, safetensors path)`` of an HF checkpoint directory, the quantization config checked."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"load_hf_checkpoint: {str(path)!r} is not a checkpoint directory")
    st = folder / WEIGHTS_NAME
    if not st.is_file():
        sharded = (folder / (WEIGHTS_NAME + ".index.json")).is_file()
        raise (ValueError if sharded else FileNotFoundError)(
            f"load_hf_checkpoint: {folder}: "
            + ("sharded checkpoints are not supported" if sharded else f"no {WEIGHTS_NAME}")
        )
    qpath, q = _quant_section(folder)
    algo = _check_quant(qpath, q)
    try:
        from safetensors.torch import load_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("load_hf_checkpoint needs safetensors: pip install safetensors") from e
    try:
        tensors = load_file(str(st))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(
            f"load_hf_checkpoint: {st} is not a readable safetensors file ({type(e).__name__}: {e})"
        ) from e
    return algo, tensors, st


_FP8_INT_KEYS = {"num_bits": 8, "unsigned": False, "narrow_range": False}


def _fp8_weight_spec(dt: str) -> dict:
    """The real spec of a per-tensor E4M3 weight (FP8, and W4A8 re-quantized to E4M3)."""
    return dict(_FP8_INT_KEYS, layout="tensor", axis=None, block_sizes=None, storage="e4m3", dtype=dt)


def _fp8_input_spec() -> dict:
    """The real spec of a static per-tensor E4M3 input."""
    return dict(_FP8_INT_KEYS, num_steps=1, elem="e4m3", dynamic=None)


def _module_spec(path, name: str, algo: str, lin: nn.Linear, local: dict, group: int | None) -> tuple[dict, dict]:
    """``(real spec, real tensors)`` of one module, its HF tensors checked (keys, dtypes, shapes)."""
    need, may = _KEYS[algo]
    extra, missing = sorted(set(local) - need - may), sorted(need - set(local))
    if extra or missing:
        what = f"unexpected tensor(s) {extra}" if extra else f"missing tensor(s) {missing}"
        raise _bad(path, f"module {name!r}", f"{what} for {algo}")
    n, k = lin.weight.shape
    dt = _DTYPE_NAMES.get(lin.weight.dtype)
    if dt is None:
        raise _bad(path, f"module {name!r}", f"the model's weight dtype {lin.weight.dtype} has no real module")
    f32 = torch.float32
    if (lin.bias is None) != ("bias" not in local):
        raise _bad(path, f"{name}.bias", "the checkpoint and the model disagree on whether there is a bias")
    out = {}
    if "bias" in local:
        out["bias"] = _want(path, f"{name}.bias", local["bias"], lin.bias.dtype, lin.bias.shape)
    spec: dict = {"type": "QuantizedLinear", "weight_shape": [n, k], "input": None, "bias": None}
    spec["bias"] = None if lin.bias is None else str(lin.bias.dtype).replace("torch.", "")
    e4m3 = torch.float8_e4m3fn
    if algo == FP8:
        out["weight"] = _want(path, f"{name}.weight", local["weight"], e4m3, (n, k))
        out["weight_scale"] = _want(path, f"{name}.weight_scale", local["weight_scale"], f32, ())
        spec["weight"] = _fp8_weight_spec(dt)
        if "input_scale" in local:
            out["input_scale"] = _want(path, f"{name}.input_scale", local["input_scale"], f32, ()).reshape(1)
            spec["input"] = _fp8_input_spec()
    elif algo in (NVFP4, NVFP4_SVD):
        if k % 16:
            raise _bad(path, f"module {name!r}", f"in_features={k} is not a multiple of the NVFP4 block 16")
        mx = {"format": "nvfp4", "scheme": "nvfp4", "elem": "e2m1", "block": 16, "rounding": "floor"}
        out["weight_packed"] = _want(path, f"{name}.weight", local["weight"], torch.uint8, (n, k // 2))
        bs = _want(path, f"{name}.weight_scale", local["weight_scale"], e4m3, (n, k // 16))
        out["weight_block_scale"] = bs.view(torch.uint8)
        out["weight_global_scale"] = _want(path, f"{name}.weight_scale_2", local["weight_scale_2"], f32, ())
        out["input_scale"] = _want(path, f"{name}.input_scale", local["input_scale"], f32, ()).reshape(1)
        spec["weight"] = dict(mx, storage="fp4", dtype=dt)
        spec["input"] = dict(mx, num_steps=1)
        out.update(_lowrank_tensors(path, name, lin, local))
    else:
        g = group if group is not None else 128
        if k % g or n % 2:
            raise _bad(path, f"module {name!r}", f"weight ({n}, {k}) does not fit INT4 row pairs in blocks of {g}")
        packed = _want(path, f"{name}.weight", local["weight"], torch.uint8, (n // 2, k))
        codes = unpack_int4_rows(packed)
        out["weight_packed"] = pack_int4(codes)
        out["weight_scale"] = _want(path, f"{name}.weight_scale", local["weight_scale"], f32, (n, k // g))
        if algo == W4A8_AWQ:
            _w4a8_as_fp8(path, name, lin, local, codes, out, spec, g, dt)
            return spec, out
        spec["weight"] = {
            "num_bits": 4,
            "unsigned": False,
            "narrow_range": False,
            "layout": "block",
            "axis": None,
            "block_sizes": {"1": g},
            "storage": "int4",
            "dtype": dt,
        }
        if "pre_quant_scale" in local:
            out["pre_quant_scale"] = _pqs(path, name, lin, local)
    return spec, out


def _w4a8_as_fp8(path, name: str, lin: nn.Linear, local: dict, codes, out: dict, spec: dict, g: int, dt: str) -> None:
    """A W4A8_AWQ module as FP8 W8A8: the INT4 weight (in the weight dtype, as the fake-quant first stage gives it)
    quantized to E4M3 by ``weight_scale_2`` (true division, saturating cast: the second stage), its input E4M3 by
    ``input_scale``; ``out`` and ``spec`` are rewritten in place."""
    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    ws2 = _want(path, f"{name}.weight_scale_2", local["weight_scale_2"], f32, ())
    if not bool(torch.isfinite(ws2) & (ws2 > 0)):
        raise _bad(path, f"{name}.weight_scale_2", f"must be finite and > 0, got {float(ws2)!r}")
    block_scale = out.pop("weight_scale")
    if not bool(torch.isfinite(block_scale).all()):
        raise _bad(path, f"{name}.weight_scale", "must be finite")
    out.pop("weight_packed")
    int4 = dequantize_weight(codes.to(torch.int8), block_scale, {1: g}).to(lin.weight.dtype)
    out["weight"] = static_codes(int4, ws2.reshape(1)).to(e4m3)
    out["weight_scale"] = ws2
    out["input_scale"] = _want(path, f"{name}.input_scale", local["input_scale"], f32, ()).reshape(1)
    spec["weight"], spec["input"] = _fp8_weight_spec(dt), _fp8_input_spec()
    if "pre_quant_scale" in local:
        out["pre_quant_scale"] = _pqs(path, name, lin, local)


def _pqs(path, name: str, lin: nn.Linear, local: dict) -> torch.Tensor:
    pqs = _want(path, f"{name}.pre_quant_scale", local["pre_quant_scale"], lin.weight.dtype, (lin.weight.shape[1],))
    if not bool((torch.isfinite(pqs) & (pqs > 0)).all()):
        raise _bad(path, f"{name}.pre_quant_scale", "must be finite and > 0")
    return pqs.float()


def _lowrank_tensors(path, name: str, lin: nn.Linear, local: dict) -> dict:
    """An NVFP4_SVD module's ``pre_quant_scale`` and SVDQuant factors (both factors or neither), checked."""
    out = {"pre_quant_scale": _pqs(path, name, lin, local)} if "pre_quant_scale" in local else {}
    a, b = (local.get(key) for key in LORA_KEYS)
    if (a is None) != (b is None):
        missing = LORA_KEYS[0] if a is None else LORA_KEYS[1]
        raise _bad(path, f"{name}.{missing}", "is missing (SVDQuant needs both factors)")
    if a is None or b is None:
        return out
    n, k = lin.weight.shape
    rank = int(a.shape[0]) if a.dim() == 2 else 0
    if rank < 1:
        raise _bad(path, f"{name}.{LORA_KEYS[0]}", f"must be 2-D (rank, {k}) with rank >= 1, got {tuple(a.shape)}")
    for key, t, shape in ((LORA_KEYS[0], a, (rank, k)), (LORA_KEYS[1], b, (n, rank))):
        _want(path, f"{name}.{key}", t, lin.weight.dtype, shape)
        if not bool(torch.isfinite(t).all()):
            raise _bad(path, f"{name}.{key}", "must be finite")
    out["lora_a"], out["lora_b"] = a, b
    return out


def _float_tensors(path, model: nn.Module, replaced: set[str], tensors: dict) -> dict:
    """The checkpoint's tensors of the float part of ``model``, checked key for key."""
    expected = {}
    for key, t in model.state_dict().items():
        if key.rpartition(".")[0] not in replaced:
            expected[key] = t
    for key, t in expected.items():
        _want(path, key, tensors.get(key), t.dtype, tuple(t.shape))
    return expected


def _owner(key: str) -> str:
    """The module a checkpoint key belongs to (SVDQuant factors sit under ``<module>.weight_quantizer.``)."""
    for lk in LORA_KEYS:
        if key.endswith("." + lk):
            return key[: -len(lk) - 1]
    return key.rpartition(".")[0]


def load_hf_checkpoint(model: nn.Module, path, backend: str = "auto") -> nn.Module:
    """Load an HF checkpoint (:func:`~.hf_export.export_hf_checkpoint`'s: FP8, W4A16 / W4A8 AWQ, NVFP4, NVFP4_SVD) into
    real modules on a fresh FLOAT ``model`` of the same architecture (its float tensors, AWQ-folded norms included, are
    loaded too). Returns ``model``, modified in place.

    Raises:
        ValueError: a malformed or corrupt checkpoint, a tensor with the wrong key, dtype, shape or value, a format
            real modules cannot compute, or a different architecture; nothing is modified then.
        FileNotFoundError: no checkpoint directory, weights file or quantization config.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_hf_checkpoint expects an nn.Module, got {type(model).__name__}")
    algo, tensors, st = read_hf_checkpoint(path)
    names = sorted({k.rpartition(".")[0] for k in tensors if k.endswith(".weight_scale")})
    if names and algo is None:
        raise _bad(st, names[0], "has quantized weights but the quantization config has no quant_algo")
    q = _quant_section(Path(path))[1]
    group = q.get("group_size", 128) if algo in (W4A16_AWQ, W4A8_AWQ) else None
    kv = kv_plans(st, model, q.get("kv_cache_quant_algo"), tensors)
    kv_keys = {k for keys in kv.values() for k in keys}
    plans = {}
    for name in names:
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            raise _bad(st, f"module {name!r}", "is not in the model (a different architecture?)") from None
        if type(lin) is not nn.Linear:
            raise _bad(st, f"module {name!r}", f"is a {type(lin).__name__} in the model; expected nn.Linear")
        local = {k[len(name) + 1 :]: t for k, t in tensors.items() if _owner(k) == name and k not in kv_keys}
        assert algo is not None  # quantized weights without a quant_algo were refused above
        spec, real = _module_spec(st, name, algo, lin, local, group)
        check_spec(st, name, spec)
        check_values(st, name, spec, {f"{name}.{k}": v for k, v in real.items()})
        why = why_not(spec, backend)
        if why is not None:
            raise ValueError(f"load_hf_checkpoint: module {name!r} ({describe(spec)}): backend {backend!r}: {why}")
        plans[name] = (spec, real, lin)
    expected = _float_tensors(st, model, set(plans), tensors)
    used = set(expected) | {k for k in tensors if _owner(k) in plans} | kv_keys
    extra = sorted(set(tensors) - used)
    if extra:
        raise _bad(st, extra[0], f"has no place in the model ({len(extra)} unexpected tensor(s))")
    for name, (spec, real, lin) in plans.items():  # everything is checked: install
        pqs = real.pop("pre_quant_scale", None)
        lora = real.pop("lora_a", None), real.pop("lora_b", None)
        built = build_real_module(spec, real, backend, device=lin.weight.device)
        built.label = name  # type: ignore[assignment]
        mod: nn.Module = built
        if lora[0] is not None and lora[1] is not None:
            n, k = lin.weight.shape
            low = LowRankLinear(built, k, n, lora[0].shape[0], lin.weight.dtype).to(lin.weight.device)
            if pqs is not None:
                low.pre_quant_scale.copy_(pqs)
            low.lora_a.copy_(lora[0])
            low.lora_b.copy_(lora[1])
            mod = low
        elif pqs is not None:
            wrap = PreScaledLinear(built, lin.weight.shape[1]).to(lin.weight.device)
            wrap.pre_quant_scale.copy_(pqs)
            mod = wrap
        mod.train(lin.training)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, mod)
    with torch.no_grad():
        for key, t in expected.items():
            t.copy_(tensors[key])
    install_kv(model, kv, q.get("kv_cache_quant_algo"))
    return model
