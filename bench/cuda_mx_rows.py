"""The NVFP4 / MX / per-tensor E5M2-E2M1 / fused dynamic block rows of bench_cuda.py (issue 24's GPU table).

Every row of ours is compared with the best exact pure-torch formulation under ``torch.compile`` in the same run:
each lean chain below is checked bit for bit against the reference (functional/microscaling.py,
functional/library_block_cuda.py) on the benchmark tensor before it is timed, and its row says "bit-exact" or "NOT EXACT".
Chains need the last dim to be a multiple of 32 (bench_cuda's tensors are).
"""

from __future__ import annotations

import torch

from modelopt_lite import tensor_quant as TQ
from modelopt_lite.functional import library_block_cuda as LB
from modelopt_lite.functional import library_mx as LMX
from modelopt_lite.functional import microscaling as MS

_EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2, "int8": 0}
_F8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def _e2m1(v: torch.Tensor) -> torch.Tensor:
    m = v.abs().clamp(max=6.0)
    step = torch.where(m < 2.0, 0.5, torch.where(m < 4.0, 1.0, 2.0))
    q = torch.round(m / step) * step
    return torch.where(v < 0, -q, q)


def _round(v: torch.Tensor, elem: str) -> torch.Tensor:
    if elem in _F8:
        dt, top = _F8[elem]
        return v.clamp(-top, top).to(dt).float()
    if elem == "e2m1":
        return _e2m1(v)
    return (v * 64.0).round().clamp(-127.0, 127.0) * 0.015625


def torch_mx(x: torch.Tensor, elem: str) -> torch.Tensor:
    """MX (floor scales) in few torch ops: the E8M0 exponent from the amax's exponent bits."""
    xb = x.float().reshape(-1, 32)
    a = xb.abs().amax(-1, keepdim=True)
    k = ((a.view(torch.int32) >> 23) & 0xFF) - 127 - _EMAX[elem]
    k = torch.where(a == 0, torch.full_like(k, -127), k.clamp(-126, 127))
    X = ((k + 127) << 23).view(torch.float32)
    return (_round(xb / X, elem) * X).reshape(x.shape).to(x.dtype)


def torch_nvfp4(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """NVFP4 (blocks of 16) in few torch ops, the reference's op order."""
    xb = x.float().reshape(-1, 16)
    s = (xb.abs().amax(-1, keepdim=True) / (gs * 6.0)).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    ds = s * gs
    dead = ds == 0
    v = xb / torch.where(dead, torch.ones_like(ds), ds)
    return torch.where(dead, torch.zeros_like(v), _e2m1(v) * ds).reshape(x.shape).to(x.dtype)


def torch_minifloat(x: torch.Tensor, s: torch.Tensor, elem: str) -> torch.Tensor:
    """Per-tensor E5M2 / E2M1: elem(x / s) * s (s a one-element tensor: true division)."""
    return (_round(x.float() / s, elem) * s).to(x.dtype)


def _torch_int_blocks(x: torch.Tensor, xb: torch.Tensor, a: torch.Tensor, bound, qmin: float, qmax: float):
    """The blocks xb of x (rows of 128) with their amax a (one per row): scale (true division by a tensor), codes
    (+0.0), dequantize (amaxes far below float32's max: no overflow guard needed)."""
    s = torch.where(a <= 2.0**-24, torch.zeros_like(a), a / bound)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = (xb / safe).round().clamp(qmin, qmax) + 0.0
    return torch.where(s == 0, torch.zeros_like(q), q * s).reshape(x.shape).to(x.dtype)


def torch_block_dynamic(x: torch.Tensor, bound: torch.Tensor, qmin: float, qmax: float) -> torch.Tensor:
    """int blocks of 128 with a dynamic amax (max |x| of each block)."""
    xb = x.float().reshape(-1, 128)
    return _torch_int_blocks(x, xb, xb.abs().amax(-1, keepdim=True), bound, qmin, qmax)


def torch_block_static(x: torch.Tensor, amax: torch.Tensor, bound: torch.Tensor, qmin: float, qmax: float):
    """int blocks of 128 with a given block amax (one per block, shape x.shape[:-1] + (blocks,))."""
    return _torch_int_blocks(x, x.float().reshape(-1, 128), amax.reshape(-1, 1), bound, qmin, qmax)


def _exact(fn, want: torch.Tensor) -> str:
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001  (a formulation that fails is reported, not fatal)
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:50]}"
    same = got.dtype == want.dtype and torch.equal(
        got.view(torch.int16 if got.element_size() == 2 else torch.int32),
        want.view(torch.int16 if want.element_size() == 2 else torch.int32),
    )
    return "bit-exact" if same else "NOT EXACT"


def reference_module():
    """The functions mx_cases calls on the extension, from the pure-torch reference (bench_cuda --dry-run-cpu)."""
    from types import SimpleNamespace

    from modelopt_lite.functional import library_minifloat as LM

    return SimpleNamespace(
        fake_nvfp4=MS.fake_nvfp4,
        nvfp4_backward=MS.nvfp4_backward,
        fake_mx=MS.fake_mx,
        mx_backward=MS.mx_backward,
        fake_e5m2=LM.fake_e5m2_reference,
        fake_e2m1=LM.fake_e2m1_reference,
        fake_block_dynamic=lambda *a: (LB.fake_block_dynamic_reference(*a), None),
        fake_block_static=lambda *a: (LB.fake_block_static_reference(*a), None),
    )


VARIANT_BITS = {  # MLQ_MX_* (mx_kernels_api.h)
    1: "NVFP4 one lane",
    2: "16-bit prefetch",
    4: "prefetch",
    8: "fp32 2 vectors",
    16: "one wave",
    32: "fp32 blocks 2 vectors",
    64: "16-bit 2 vectors",
    128: "16-bit true division",
}


def _variant_name(v: int) -> str:
    return " + ".join(name for bit, name in VARIANT_BITS.items() if v & bit) or "none"


def _under_variant(mod, v: int, fn):
    """fn() with the kernels' work-distribution variant set to v (mx_set_variant), restored after."""

    def run():
        prev = mod.mx_set_variant(v)
        try:
            return fn()
        finally:
            mod.mx_set_variant(prev)

    return run


def variant_rows(mod, fn, variants, label: str = "modelopt_lite, flag not read") -> list:
    """One row per work-distribution variant of ``fn`` (a binding call that does not read the kernel's flag back),
    the default first: what each variant of the same kernel takes, in the same run."""
    if not hasattr(mod, "mx_set_variant"):
        return []
    default = mod.mx_set_variant(-1)
    rows = [(f"{label}, default variant {default} ({_variant_name(default)})", fn, "")]
    for v in variants:
        if v != default:
            rows.append((f"{label}, variant {v} ({_variant_name(v)})", _under_variant(mod, v, fn), ""))
    return rows


def mx_cases(mod, x: torch.Tensor, compile_chains: bool):
    """(case, bytes moved, [(impl, callable or 'n/a ...', note)]) for bench_cuda.py."""
    n, es = x.numel(), x.element_size()
    rw = 2 * n * es
    x2 = x.view(-1, 4096)
    amax = x.float().abs().amax()
    gs = MS.nvfp4_global_scale(amax)
    cases = []

    def chain(name, ref_fn, eager, *args):
        impls = []
        want = ref_fn()
        impls.append(("pure torch eager chain", lambda: eager(*args), _exact(lambda: eager(*args), want)))
        if compile_chains:
            c = torch.compile(eager, dynamic=False)
            note = _exact(lambda: c(*args), want)
            impls.append(("torch.compile(chain)", lambda: c(*args), note))
        return impls

    ours_nv = [("modelopt_lite", lambda: mod.fake_nvfp4(x2, gs, 16), "")]
    if x.is_cuda:  # the public op in its default (deferred) error-check mode: no host read per call
        ours_nv.append(("public nvfp4_fake_quant", lambda: LMX.nvfp4_fake_quant(x2, amax, 16), "checks deferred"))
    ours_nv += variant_rows(mod, lambda: mod.fake_nvfp4_flagged(x2, gs, 16)[0], (0, 1, 3, 8, 27, 171))
    ours_nv.append(("modelopt_lite backward (STE)", lambda: mod.nvfp4_backward(x2, x2, gs, 16), "reads 2, writes 1"))
    ours_nv += [
        (f"{name} (backward)", fn, "reads 2, writes 1")
        for name, fn, _ in variant_rows(mod, lambda: mod.nvfp4_backward_flagged(x2, x2, gs, 16)[0], (0, 16))
    ]
    cases.append(
        ("NVFP4 fake quant", rw, ours_nv + chain("nvfp4", lambda: MS.fake_nvfp4(x2, gs, 16), torch_nvfp4, x2, gs))
    )
    for elem, label in (("e4m3", "MXFP8 E4M3"), ("e2m1", "MXFP4 E2M1"), ("int8", "MXINT8"), ("e5m2", "MX E5M2")):
        ours = [("modelopt_lite", lambda e=elem: mod.fake_mx(x2, e, 32, "floor"), "")]
        if x.is_cuda:
            ours.append(("public mx_fake_quant", lambda e=elem: LMX.mx_fake_quant(x2, e), "checks deferred"))
        ours += variant_rows(
            mod,
            lambda e=elem: mod.fake_mx_flagged(x2, e, 32, "floor")[0],
            (0, 3, 16, 24, 75) if elem == "e4m3" else (0, 3, 24, 75),
        )
        if elem in ("e4m3", "e2m1"):
            ours.append(("modelopt_lite backward (STE)", lambda e=elem: mod.mx_backward(x2, x2, e, 32, "floor"), ""))
        if elem == "e4m3":
            ours += [
                (f"{name} (backward)", fn, "")
                for name, fn, _ in variant_rows(
                    mod, lambda: mod.mx_backward_flagged(x2, x2, "e4m3", 32, "floor")[0], (0, 16)
                )
            ]
        ref = lambda e=elem: MS.fake_mx(x2, e, 32, "floor")  # noqa: E731
        cases.append((f"{label} fake quant", rw, ours + chain(elem, ref, torch_mx, x2, elem)))
    for fn, elem, bound in (("fake_e5m2", "e5m2", 57344.0), ("fake_e2m1", "e2m1", 6.0)):
        s = (amax / torch.tensor(bound, device=x.device)).reshape(1)
        ours = [("modelopt_lite", lambda f=fn, s=s: getattr(mod, f)(x2, s), "")]
        ours += variant_rows(mod, lambda f=fn, s=s: getattr(mod, f)(x2, s), (16, 171), "modelopt_lite")[1:]
        ref = lambda e=elem, s=s: torch_minifloat(x2, s, e)  # noqa: E731  (the chain is the definition here)
        cases.append((f"{elem.upper()} per-tensor", rw, ours + chain(elem, ref, torch_minifloat, x2, s, elem)))
    bound = torch.tensor(7.0, device=x.device)
    blk = [("modelopt_lite fused kernel", lambda: mod.fake_block_dynamic(x2, 128, 7.0, -8, 7, False)[0], "")]
    blk += variant_rows(
        mod, lambda: mod.fake_block_dynamic(x2, 128, 7.0, -8, 7, False)[0], (0, 11, 43, 59, 107, 171), "fused kernel"
    )[1:]
    if x.is_cuda:  # the public function, checks deferred (no host read per call)
        blk.append(("public fake_block_quant", lambda: TQ.fake_block_quant(x2, {-1: 128}, None, 4), "checks deferred"))
    ref = lambda: LB.fake_block_dynamic_reference(x2, 128, 7.0, -8, 7, False)  # noqa: E731
    cases.append(
        (
            "int4 blocks of 128, dynamic amax (fused)",
            rw,
            blk + chain("blk", ref, torch_block_dynamic, x2, bound, -8.0, 7.0),
        )
    )
    # a static (calibrated) block amax: the data's own, scaled by 0.9 (some elements clip)
    amax_blk = TQ.blocks.block_amax(x2, {-1: 128}) * 0.9
    sta = [("modelopt_lite fused kernel", lambda: mod.fake_block_static(x2, amax_blk, 128, 7.0, -8, 7, False)[0], "")]
    sta += variant_rows(
        mod, lambda: mod.fake_block_static(x2, amax_blk, 128, 7.0, -8, 7, False)[0], (171,), "fused kernel"
    )[1:]
    if x.is_cuda:
        sta.append(
            ("public fake_block_quant", lambda: TQ.fake_block_quant(x2, {-1: 128}, amax_blk, 4), "checks deferred")
        )
    ref_s = lambda: LB.fake_block_static_reference(x2, amax_blk, 128, 7.0, -8, 7, False)  # noqa: E731
    cases.append(
        (
            "int4 blocks of 128, static amax (fused)",
            rw,
            sta + chain("blks", ref_s, torch_block_static, x2, amax_blk, bound, -8.0, 7.0),
        )
    )
    return cases
