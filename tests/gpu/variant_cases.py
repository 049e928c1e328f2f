"""The work-distribution variants of the NVFP4 / MX / E5M2 / E2M1 and block kernels (``mx_set_variant``, bits
``MLQ_MX_*`` of mx_kernels_api.h): the NVFP4/MX forward under every variant against the reference
(:func:`variant_failures`), and :func:`under_variants`, which block_cases.py uses for the fused block kernel's.
Shared by tests/gpu/test_cuda_mx.py (real GPU) and the host-emulated binding test."""

from __future__ import annotations

import torch
from cuda_cases import DTYPES, assert_same
from mx_cases import ELEMS, REFERENCE, amax_of, data

from modelopt_lite.functional import microscaling as ms

VARIANTS = 256  # MLQ_MX_VARIANT_ALL + 1 (bits: 1 NVFP4 one lane, 2 16-bit prefetch, 4 prefetch, 8 fp32 2 vectors,
# 16 one wave of thread blocks, 32 fp32 dynamic blocks 2 vectors (block_cases.variant_failures), 64 16-bit MX and
# dynamic blocks 2 vectors, 128 16-bit NVFP4, block and elementwise kernels divide by __fdiv_rn, not through the
# reciprocal)
DEFAULT_VARIANT = 43  # MLQ_MX_VARIANT_DEFAULT
VARIANT_SHAPES = {
    "4x64 full blocks": (4, 64),
    "67x256 full blocks, many warp tiles": (67, 256),
    "2x3x48 3-D": (2, 3, 48),
}


def _variant_checks() -> list:
    """(label, binding function, x, other arguments, the reference's output) of variant_failures, the references
    computed once."""
    out = []
    for dtype in DTYPES:
        for si, (name, shape) in enumerate({**VARIANT_SHAPES, "6x83 partial": (6, 83)}.items()):
            x = data(shape, dtype, 300 + si)
            gs = ms.nvfp4_global_scale(amax_of(x))
            checks = [(f"nvfp4 block={b}", "fake_nvfp4", (gs, b)) for b in (16, 32)]
            checks += [(f"mx {e}", "fake_mx", (e, 32, "floor")) for e in ELEMS]
            out += [(f"{what} {name} {dtype}", fn, x, rest, REFERENCE[fn](x, *rest)) for what, fn, rest in checks]
    return out


def under_variants(mod, variants, failures: list[str]):
    """Yield each of ``variants`` with it set as the process-wide work-distribution variant (``mx_set_variant``,
    checked to read back); the variant in force before is restored after, a failure noted where it is not."""
    default = mod.mx_set_variant(-1)
    try:
        for variant in variants:
            if mod.mx_set_variant(variant) not in range(VARIANTS):
                failures.append(f"variant {variant}: mx_set_variant returned an unknown previous variant")
            if mod.mx_set_variant(-1) != variant:
                failures.append(f"variant {variant}: mx_set_variant(-1) does not read it back")
            yield variant
    finally:
        mod.mx_set_variant(default)
    if mod.mx_set_variant(-1) != default:
        failures.append("the variant was not restored")


def variant_failures(mod, device: str) -> list[str]:
    """The forward kernels under every work-distribution variant (``mx_set_variant``: NVFP4 one lane per block,
    prefetch, 2 float32 vectors per lane, one wave of thread blocks) against the reference,
    on aligned whole-block inputs (the layouts the variants take) and a partial one; the process-wide variant is
    restored after, and a variant out of range is refused."""
    failures: list[str] = []
    checks = _variant_checks()
    for variant in under_variants(mod, range(VARIANTS), failures):
        for label, fn, x, rest, want in checks:
            got = getattr(mod, fn)(x.to(device), *[r.to(device) if torch.is_tensor(r) else r for r in rest])
            try:
                assert_same(got, want, f"variant {variant} {label}")
            except AssertionError as e:
                failures.append(str(e))
        if variant == VARIANTS - 1 and (mod.mx_set_variant(VARIANTS) != variant or mod.mx_set_variant(-1) != variant):
            failures.append(f"variant {VARIANTS} (out of range) was not refused")
    return failures
