"""NVFP4 and MXFP8 rows of bench_fake_quant.py: modelopt_lite's native kernels next to the best pure-torch
formulations (the reference of functional/microscaling.py, a leaner eager chain, and that chain under torch.compile).

Every pure-torch formulation is checked bit for bit against the reference on the benchmark tensor before it is
timed; a formulation that differs is reported as such (its time is still shown, marked "NOT EXACT").
"""

from __future__ import annotations

import torch

from modelopt_lite.functional import backend
from modelopt_lite.functional import microscaling as MS

NVFP4_NATIVE = "modelopt_lite NVFP4 (native kernel)"
MXFP8_NATIVE = "modelopt_lite MXFP8 E4M3 (native kernel)"
PREALLOC = ", preallocated y"
#: the fresh output as the kernels made it before csrc/output_pool.h: torch's allocator (page faults every call)
TORCH_OUT = ", into torch.empty_like(x)"
#: The pure-torch rows each native kernel is compared with (the fastest one measured counts).
TORCH_ROWS = {
    "NVFP4": ("pure torch: reference fake_nvfp4", "pure torch: lean NVFP4 chain", "torch.compile(lean NVFP4 chain)"),
    "MXFP8": ("pure torch: reference fake_mx e4m3", "pure torch: lean MXFP8 chain", "torch.compile(lean MXFP8 chain)"),
}


def torch_nvfp4(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quant in few torch ops (blocks of 16; the last dim a multiple of 16), the reference's op order."""
    xb = x.float().reshape(-1, 16)
    s = (xb.abs().amax(-1, keepdim=True) / (gs * 6.0)).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    ds = s * gs
    dead = ds == 0
    v = xb / torch.where(dead, torch.ones_like(ds), ds)
    m = v.abs().clamp(max=6.0)
    step = torch.where(m < 2.0, 0.5, torch.where(m < 4.0, 1.0, 2.0))
    q = torch.round(m / step) * step
    q = torch.where(v < 0, -q, q)
    return torch.where(dead, torch.zeros_like(q), q * ds).reshape(x.shape).to(x.dtype)


def torch_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 (E4M3, floor) fake quant in few torch ops: the E8M0 exponent from the amax's exponent bits (exact for
    normal amaxes; the last dim a multiple of 32)."""
    xb = x.float().reshape(-1, 32)
    a = xb.abs().amax(-1, keepdim=True)
    k = ((a.view(torch.int32) >> 23) & 0xFF) - 127 - 8  # floor(log2(a)) - emax(E4M3)
    k = torch.where(a == 0, torch.full_like(k, -127), k.clamp(-126, 127))
    X = ((k + 127) << 23).view(torch.float32)
    y = (xb / X).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * X
    return y.reshape(x.shape).to(x.dtype)


def _exact(fn, want: torch.Tensor) -> str:
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001  (a formulation that fails is reported, not fatal)
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    same = got.dtype == want.dtype and torch.equal(
        got.view(torch.int8) if got.dtype == want.dtype else got, want.view(torch.int8)
    )
    return "bit-exact vs reference" if same else "NOT EXACT vs reference"


def mx_cases(x: torch.Tensor, include_compile: bool):
    """(name, fn, note) rows for x (its last dim a multiple of 32)."""
    amax = x.detach().float().abs().amax()
    gs = MS.nvfp4_global_scale(amax)
    native = backend.kernels_for(x.device.type)
    rows = []
    ref_nv = MS.fake_nvfp4(x, gs, 16)
    ref_mx = MS.fake_mx(x, "e4m3", 32, "floor")
    if hasattr(native, "fake_nvfp4"):
        y = torch.empty_like(x)
        if x.device.type == "cpu":  # the CPU kernels take out= (the kernel without a fresh output's page faults)
            rows.append((NVFP4_NATIVE + PREALLOC, lambda: native.fake_nvfp4(x, gs, 16, y), "as y.copy_(x)"))
            rows.append((MXFP8_NATIVE + PREALLOC, lambda: native.fake_mx(x, "e4m3", 32, "floor", y), "as y.copy_(x)"))
            rows.append(
                (NVFP4_NATIVE + TORCH_OUT, lambda: native.fake_nvfp4(x, gs, 16, torch.empty_like(x)), "no pool")
            )
            rows.append(
                (
                    MXFP8_NATIVE + TORCH_OUT,
                    lambda: native.fake_mx(x, "e4m3", 32, "floor", torch.empty_like(x)),
                    "no pool",
                )
            )
        rows.append(
            (NVFP4_NATIVE, lambda: native.fake_nvfp4(x, gs, 16), _exact(lambda: native.fake_nvfp4(x, gs, 16), ref_nv))
        )
        rows.append(
            (
                MXFP8_NATIVE,
                lambda: native.fake_mx(x, "e4m3", 32, "floor"),
                _exact(lambda: native.fake_mx(x, "e4m3", 32, "floor"), ref_mx),
            )
        )
    try:
        from modelopt_lite.functional import library_mx  # the validated entry points (quantizers call these)

        rows.append(
            (
                "modelopt_lite nvfp4_fake_quant (entry point)",
                lambda: library_mx.nvfp4_fake_quant(x, amax, 16),
                "+ input checks",
            )
        )
        rows.append(
            (
                "modelopt_lite mx_fake_quant e4m3 (entry point)",
                lambda: library_mx.mx_fake_quant(x, "e4m3"),
                "+ input checks",
            )
        )
    except ImportError:
        pass
    rows.append(("pure torch: reference fake_nvfp4", lambda: MS.fake_nvfp4(x, gs, 16), "functional/microscaling.py"))
    rows.append(
        ("pure torch: lean NVFP4 chain", lambda: torch_nvfp4(x, gs), _exact(lambda: torch_nvfp4(x, gs), ref_nv))
    )
    rows.append(
        ("pure torch: reference fake_mx e4m3", lambda: MS.fake_mx(x, "e4m3", 32, "floor"), "functional/microscaling.py")
    )
    rows.append(("pure torch: lean MXFP8 chain", lambda: torch_mxfp8(x), _exact(lambda: torch_mxfp8(x), ref_mx)))
    if include_compile:
        c_nv = torch.compile(torch_nvfp4)
        c_mx = torch.compile(torch_mxfp8)
        rows.append(
            ("torch.compile(lean NVFP4 chain)", lambda: c_nv(x, gs), "inductor; " + _exact(lambda: c_nv(x, gs), ref_nv))
        )
        rows.append(
            ("torch.compile(lean MXFP8 chain)", lambda: c_mx(x), "inductor; " + _exact(lambda: c_mx(x), ref_mx))
        )
    return rows


def mx_summary(med: dict[str, float]) -> list[str]:
    """The two goals per format: native time vs the preallocated copy (>= 50% of its bandwidth) and vs the fastest
    pure-torch formulation measured in the same run (>= 5x)."""
    copy = med.get("y.copy_(x), preallocated y")
    out = []
    for native, tag in ((NVFP4_NATIVE, "NVFP4"), (MXFP8_NATIVE, "MXFP8")):
        if native not in med or copy is None:
            out.append(f"{tag}: native kernel not timed")
            continue
        torch_rows = {
            k: v
            for k, v in med.items()
            if tag in k.upper().replace("FAKE_MX E4M3", "MXFP8") and "torch" in k and not k.startswith("modelopt_lite")
        }
        best = min(torch_rows.items(), key=lambda kv: kv[1]) if torch_rows else None
        line = f"{tag}: native {med[native]:.1f} ms (fresh output) = {100 * copy / med[native]:.0f}% of copy_ bandwidth"
        pre = med.get(native + PREALLOC)
        if pre:
            line += f", into a preallocated y {pre:.1f} ms = {100 * copy / pre:.0f}%"
        fresh = med.get(native + TORCH_OUT)
        if fresh:
            line += f", into torch.empty_like(x) (no pool) {fresh:.1f} ms = {100 * copy / fresh:.0f}%"
        if best:
            line += f"; {best[1] / med[native]:.1f}x faster than the best pure-torch ({best[0]}, {best[1]:.1f} ms)"
            line += f"; a kernel at copy_ speed would be {best[1] / copy:.1f}x faster"  # the physical bound
        out.append(line)
    return out
