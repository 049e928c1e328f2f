"""Which unified-HF-checkpoint format each quantized module has, and the quantization config files describing them.

Formats (ModelOpt's names in ``hf_quant_config.json``):

- ``FP8``: E4M3 weights and activations, per tensor (weight-only FP8 too: no ``input_scale`` then);
- ``W4A16_AWQ``: INT4 weights in blocks along the input dim, activations float (INT4 AWQ, or plain INT4 blocks);
- ``W4A8_AWQ``: the weight quantized twice (a ``SequentialQuantizer``: INT4 blocks, then E4M3 per tensor) and
  E4M3 per-tensor activations;
- ``NVFP4``: NVFP4 weights and activations (E2M1 in blocks of 16 with E4M3 block scales and a float32 global scale);
- ``NVFP4_SVD``: NVFP4 with SVDQuant's float low-rank branch (``svdquant_lora_a`` / ``_b`` on the weight quantizer)
  and its AWQ ``pre_quant_scale``; once any NVFP4 module has the branch, every NVFP4 module is ``NVFP4_SVD`` (those
  without it, e.g. ``skip_layers``, simply have no factors), as ModelOpt classifies them. The branch on any other
  format is a ValueError: ModelOpt's unified checkpoint defines it for NVFP4 only;
- KV cache (``k_bmm_quantizer`` / ``v_bmm_quantizer`` of an attention module): ``FP8`` or ``NVFP4``.

Anything else that is enabled is a ValueError naming the module and what it has. A model holds one weight format
(ModelOpt's ``MIXED_PRECISION`` layout is not written here).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..nn.sequential_quantizer import SequentialQuantizer

FP8, W4A16_AWQ, W4A8_AWQ, NVFP4, NVFP4_SVD = "FP8", "W4A16_AWQ", "W4A8_AWQ", "NVFP4", "NVFP4_SVD"
FORMATS = (FP8, W4A16_AWQ, W4A8_AWQ, NVFP4, NVFP4_SVD)
#: formats whose shared-input modules are fused at export (ModelOpt leaves FP8 groups alone)
FUSED_FORMATS = (W4A16_AWQ, W4A8_AWQ, NVFP4, NVFP4_SVD)
AWQ_FORMATS = (W4A16_AWQ, W4A8_AWQ)
#: formats whose hf_quant_config.json says ``has_zero_point`` / ``pre_quant_scale``
PQS_FORMATS = (W4A16_AWQ, W4A8_AWQ, NVFP4_SVD)
KV_FORMATS = (FP8, NVFP4)
PRODUCER = "modelopt_lite"
_QUANTIZER_ATTRS = ("weight_quantizer", "input_quantizer")


def _fail(name: str, why: str) -> ValueError:
    return ValueError(
        f"export_hf_checkpoint: module {name!r}: {why}; the unified HF checkpoint holds {', '.join(FORMATS)} "
        "(disable this module's quantizers to keep it in float)"
    )


def _enabled(q) -> bool:
    if q is None:
        return False
    if isinstance(q, SequentialQuantizer):
        return any(x.is_enabled for x in q)
    return bool(q.is_enabled)


def _describe(info: dict) -> str:
    return (
        f"{info['kind']} num_bits={info['num_bits']} axis={info['axis']} block_sizes={info['block_sizes']} "
        f"dynamic={info['dynamic']}"
    )


def _is_e4m3_tensor(info: dict) -> bool:
    return info["kind"] == "e4m3" and not info["block_sizes"] and info["axis"] is None and not info["dynamic"]


def _is_int4_rows(info: dict) -> bool:
    bs = info["block_sizes"] or {}
    axes = [k for k in bs if not isinstance(k, str)]
    return (
        info["kind"] == "block"
        and info["num_bits"] == 4
        and not info["unsigned"]
        and not info["narrow_range"]
        and axes in ([1], [-1])
        and not info["dynamic"]
    )


def check_calibrated(name: str, q) -> None:
    """ValueError naming ``q`` when it is enabled, static and has no amax."""
    parts = list(q) if isinstance(q, SequentialQuantizer) else [q]
    for i, p in enumerate(parts):
        if p.is_enabled and not p.quant_desc.dynamic and not p.has_amax:
            where = f"{name}[{i}]" if isinstance(q, SequentialQuantizer) else name
            raise ValueError(
                f"export_hf_checkpoint: quantizer {where!r} is not calibrated (no amax); calibrate the model first "
                "(modelopt_lite.quantize(model, config, forward_loop)) or disable it"
            )
        if p.is_enabled and p.is_calib_enabled:
            raise ValueError(f"export_hf_checkpoint: quantizer {name!r} is still calibrating; finish calibration first")


def has_lowrank(module: Any) -> bool:
    """Whether ``module``'s weight quantizer holds SVDQuant factors."""
    return bool(getattr(getattr(module, "weight_quantizer", None), "has_lowrank", False))


def _weight_format(name: str, wq, iq) -> str:
    in_info = iq.export_info() if _enabled(iq) else None
    if isinstance(wq, SequentialQuantizer):
        parts = [q for q in wq if q.is_enabled]
        infos = [q.export_info() for q in parts]
        if len(parts) != 2 or not _is_int4_rows(infos[0]) or not _is_e4m3_tensor(infos[1]):
            got = "; ".join(_describe(i) for i in infos)
            raise _fail(name, f"its SequentialQuantizer weight ({got}) is not W4A8 (INT4 blocks, then E4M3 per tensor)")
        if in_info is None or not _is_e4m3_tensor(in_info):
            got = "disabled" if in_info is None else _describe(in_info)
            raise _fail(name, f"W4A8 weights need E4M3 per-tensor static activations, the input_quantizer is {got}")
        return W4A8_AWQ
    info = wq.export_info()
    if _is_e4m3_tensor(info):
        if in_info is not None and not _is_e4m3_tensor(in_info):
            raise _fail(name, f"FP8 weights with a {_describe(in_info)} input_quantizer")
        return FP8
    if _is_int4_rows(info):
        if in_info is not None:
            raise _fail(name, f"INT4 block weights with a {_describe(in_info)} input_quantizer (W4A16 AWQ has none)")
        return W4A16_AWQ
    if info["kind"] == "nvfp4":
        if in_info is None or in_info["kind"] != "nvfp4":
            got = "disabled" if in_info is None else _describe(in_info)
            raise _fail(name, f"NVFP4 weights need NVFP4 activations, the input_quantizer is {got}")
        return NVFP4_SVD if getattr(wq, "has_lowrank", False) else NVFP4
    raise _fail(name, f"the weight_quantizer ({_describe(info)}) has no unified HF checkpoint format")


def module_format(name: str, module: Any) -> str | None:
    """The HF format of a quantized module, or None (float); ValueError for what the checkpoint cannot hold."""
    wq, iq = getattr(module, "weight_quantizer", None), getattr(module, "input_quantizer", None)
    oq = getattr(module, "output_quantizer", None)
    for attr, q in (("weight_quantizer", wq), ("input_quantizer", iq), ("output_quantizer", oq)):
        if q is not None:
            check_calibrated(f"{name}.{attr}", q)
    if _enabled(oq):
        raise _fail(name, "the output_quantizer is enabled; the unified HF checkpoint has no output scales")
    if not _enabled(wq):
        if _enabled(iq):
            raise _fail(name, "the input_quantizer is enabled while the weight is not quantized")
        return None
    if not isinstance(getattr(module, "weight", None), nn.Parameter) or module.weight.dim() != 2:
        raise _fail(name, f"{type(module).__name__} has no 2-D weight; only Linear-like modules are exported")
    if getattr(iq, "bias", None) is not None:
        raise _fail(name, "the input_quantizer is affine (has a bias)")
    fmt = _weight_format(name, wq, iq)
    if has_lowrank(module) and fmt != NVFP4_SVD:
        raise _fail(
            name,
            f"it has an SVDQuant low-rank branch on {fmt} weights; ModelOpt's unified checkpoint defines the branch "
            "for NVFP4 only (NVFP4_SVD)",
        )
    return fmt


def kv_format(name: str, module: Any) -> str | None:
    """The KV-cache format of an attention module (``FP8`` / ``NVFP4``), or None."""
    qs: list[Any] = [getattr(module, a, None) for a in ("k_bmm_quantizer", "v_bmm_quantizer")]
    on = [q for q in qs if _enabled(q)]
    if not on:
        return None
    found = set()
    for attr, q in zip(("k_bmm_quantizer", "v_bmm_quantizer"), qs):
        if not _enabled(q):
            raise _fail(name, f"only one of k_bmm_quantizer / v_bmm_quantizer is enabled ({attr} is not)")
        check_calibrated(f"{name}.{attr}", q)
        info = q.export_info()
        if info["dynamic"] or info["axis"] is not None or getattr(q, "bias", None) is not None:
            raise _fail(name, f"{attr} ({_describe(info)}) is not a static per-tensor KV-cache quantizer")
        if info["kind"] == "e4m3" and not info["block_sizes"]:
            found.add(FP8)
        elif info["kind"] == "nvfp4":
            found.add(NVFP4)
        else:
            raise _fail(name, f"{attr} ({_describe(info)}) has no KV-cache format (FP8 or NVFP4)")
    if len(found) != 1:
        raise _fail(name, f"K and V are quantized to different formats {sorted(found)}")
    return found.pop()


def has_quantizers(module: nn.Module) -> bool:
    """Whether ``module`` is a quantized module (it has a weight or input quantizer, enabled or not)."""
    return any(getattr(module, a, None) is not None for a in _QUANTIZER_ATTRS)


def summarize_excluded(excluded, quantized) -> list[str]:
    """The float modules as ModelOpt lists them: a name, or a dotted prefix wildcard (``a.b*`` / ``a.b.*``) that
    matches no quantized module."""
    quantized = list(quantized)
    blocked = set(quantized)
    for q in quantized:
        blocked.update(q[:i] + "*" for i in range(len(q) + 1))
    out: set[str] = set()
    for name in excluded:
        options: list[list[str]] = []
        for i, ch in enumerate(name):
            if ch == ".":
                options += [[name[:i] + "*"], [name[:i], name[:i] + ".*"]]
        options.append([name])
        for opt in options:
            if any(w in blocked for w in opt):
                continue
            if not all(w in out for w in opt):
                out.update(opt[1:] if len(opt) == 2 else opt)  # the pair (a, a.*) is written as a.* alone
            break
    return sorted(out)


def hf_quant_config(formats: dict, kv: str | None, group_size: int | None, excluded: list[str], version: str) -> dict:
    """``hf_quant_config.json``: ``{"producer", "quantization": {"quant_algo", "kv_cache_quant_algo", ...}}``."""
    algos = sorted(set(formats.values()))
    if len(algos) > 1:
        example = {a: next(n for n, f in formats.items() if f == a) for a in algos}
        raise ValueError(
            f"export_hf_checkpoint: the model mixes formats {example} (format: a module that has it); "
            "one weight format per checkpoint is supported"
        )
    algo = algos[0] if algos else None
    q: dict = {"quant_algo": algo, "kv_cache_quant_algo": kv}
    if algo in (W4A16_AWQ, W4A8_AWQ, NVFP4, NVFP4_SVD):
        q["group_size"] = group_size
    if algo in PQS_FORMATS:
        q["has_zero_point"] = False
        q["pre_quant_scale"] = True
    q["exclude_modules"] = summarize_excluded(excluded, formats)
    return {"producer": {"name": PRODUCER, "version": version}, "quantization": q}


def config_json_entry(hf_cfg: dict) -> dict:
    """The ``quantization_config`` entry of ``config.json`` (the compressed-tensors style ModelOpt writes)."""
    q = hf_cfg["quantization"]
    algo = q["quant_algo"]
    out: dict[str, Any] = {}
    if algo == FP8:
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        out["config_groups"] = {
            "group_0": {"input_activations": dict(fp8), "weights": dict(fp8), "targets": ["Linear"]}
        }
    elif algo in (NVFP4, NVFP4_SVD):
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
        group: dict[str, Any] = {"input_activations": dict(fp4), "weights": dict(fp4)}
        if algo == NVFP4_SVD:  # ModelOpt: NVFP4 plus the pre_quant_scale flags (no rank: it reads the factors)
            group.update(has_zero_point=False, pre_quant_scale=True)
        out["config_groups"] = {"group_0": dict(group, targets=["Linear"])}
    out["ignore"] = list(q["exclude_modules"])
    if algo:
        out["quant_algo"] = algo
    kv = q["kv_cache_quant_algo"]
    if kv:
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"} if kv == FP8 else kv
    out["producer"] = dict(hf_cfg["producer"])
    out["quant_method"] = "modelopt"
    return out
