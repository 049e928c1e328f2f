"""Static NVFP4 (ModelOpt's StaticBlockScaleQuantizer format): stored block amaxes + a global amax, dynamic NVFP4's
numerics (the one reference in functional/microscaling.py) with those amaxes in place of the input's."""

from __future__ import annotations

import pytest
import torch

from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.functional.library_nvfp4_static import nvfp4_static_fake_quant
from modelopt_lite.nn import TensorQuantizer

STATIC = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
DYNAMIC = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def calibrated(w: torch.Tensor, name: str = "layer.weight_quantizer") -> TensorQuantizer:
    q = TensorQuantizer(STATIC, name=name)
    q.disable_quant()
    q.enable_calib()
    q(w)
    q.load_calib_amax()
    q.disable_calib()
    q.enable_quant()
    return q


def _weight(shape=(6, 40), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1])  # blocks of very different ranges
    w[1, :16] = 0.0  # an all-zero (dead) block
    return w


def test_descriptor_static_nvfp4():
    d = QuantDescriptor(**STATIC)
    assert d.nvfp4_static and d.per_block_amax and not d.dynamic and d.block_scheme.name == "nvfp4"
    dyn = QuantDescriptor(**DYNAMIC)
    assert not dyn.nvfp4_static and not dyn.per_block_amax
    with pytest.raises(ValueError, match="one amax per block: dynamic=True"):
        QuantDescriptor(**STATIC, dynamic=True)
    mxs = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "static", "scale_bits": (8, 0)}}
    with pytest.raises(ValueError, match="MXFP8 computes its block scales from each input"):
        QuantDescriptor(**mxs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 40), (3, 2, 32), (5, 7)])  # 40 and 7: a partial last block
def test_max_calibrated_static_equals_dynamic(dtype, shape):
    w = _weight(shape).to(dtype)
    q = calibrated(w)
    nb = -(-shape[-1] // 16)
    assert q.amax.shape == (*shape[:-1], nb) and q.amax.dtype == torch.float32
    assert q.global_amax.dtype == torch.float32 and q.global_amax.shape == ()
    assert torch.equal(q.global_amax, w.float().abs().amax())
    assert torch.equal(q.amax, mx._block_amax(mx._blocks(w, 16)))
    dyn = TensorQuantizer(DYNAMIC)
    y, yd = q(w), dyn(w)
    assert y.dtype == dtype and torch.equal(y, yd)
    assert torch.equal(y, mx.fake_nvfp4(w, mx.nvfp4_global_scale(w.float().abs().amax()), 16))


def test_hand_set_block_amax_changes_exactly_that_block():
    w = _weight((4, 48))
    q = calibrated(w)
    before = q(w)
    a = q.amax.clone()
    a[2, 1] *= 0.5  # clip block (row 2, columns 16..31)
    q.amax = a
    assert torch.equal(q.global_amax, w.abs().amax())  # the global amax stays
    after = q(w)
    changed = (after != before).nonzero().tolist()
    assert changed and all(r == 2 and 16 <= c < 32 for r, c in changed)
    assert after[2, 16:32].abs().max() < before[2, 16:32].abs().max()
    # the changed block is the reference's with that block amax
    gs = mx.nvfp4_global_scale(q.global_amax)
    assert torch.equal(after, mx.fake_nvfp4(w, gs, 16, block_amax=a))


def test_global_amax_is_used_and_settable():
    w = _weight((4, 32))
    q = calibrated(w)
    q.global_amax = q.global_amax * 4
    gs = mx.nvfp4_global_scale(q.global_amax)
    assert torch.equal(q(w), mx.fake_nvfp4(w, gs, 16, block_amax=q.amax))
    assert torch.equal(q.scale, gs)
    with pytest.raises(ValueError, match="global_amax must be one value"):
        q.global_amax = torch.ones(2)
    with pytest.raises(ValueError, match="global_amax applies to static NVFP4"):
        TensorQuantizer(DYNAMIC, name="d").global_amax = 1.0


def test_validation_names_the_quantizer():
    w = _weight((4, 32))
    q = TensorQuantizer(STATIC, name="fc.weight_quantizer")
    # uncalibrated: the input's own block maxima (dynamic NVFP4, as ModelOpt's fallback); LSQ refuses it
    assert torch.equal(q(w), TensorQuantizer(DYNAMIC)(w))
    q.global_amax = 7.0  # a set global amax is kept: dynamic NVFP4 under that amax
    assert torch.equal(q(w), TensorQuantizer(DYNAMIC, amax=7.0)(w)) and q.amax is None
    q.global_amax = None
    with pytest.raises(ValueError, match=r"'fc.weight_quantizer': enable_lsq needs a calibrated static NVFP4"):
        q.enable_lsq()
    bad = w.clone()
    bad[0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"'fc.weight_quantizer'.*NVFP4 input contains NaN or Inf"):
        q(bad)
    q = calibrated(w, "fc.weight_quantizer")
    for bad in (float("nan"), -1.0, float("inf")):
        a = q.amax.clone()
        a[0, 0] = bad
        with pytest.raises(ValueError, match=r"'fc.weight_quantizer'.*amax must be finite and >= 0"):
            q.amax = a
        with pytest.raises(ValueError, match="NVFP4 block amax must be finite and >= 0"):
            nvfp4_static_fake_quant(w, a, 1.0)
    with pytest.raises(ValueError, match=r"'fc.weight_quantizer'.*global_amax: amax must be finite"):
        q.global_amax = float("nan")
    with pytest.raises(ValueError, match=r"'fc.weight_quantizer'.*block amax has shape \(4, 3\).*needs \(4, 2\)"):
        q.reset_amax()
        q.amax = torch.ones(4, 3)
        q(w)
    with pytest.raises(ValueError, match="NVFP4 global amax must be finite and >= 0"):
        nvfp4_static_fake_quant(w, torch.ones(4, 2), -1.0)


def test_reset_forgets_global_amax_and_half_keeps_float32():
    w = _weight((4, 32))
    q = calibrated(w)
    q.half()
    assert q.amax.dtype == torch.float32 and q._global_amax.dtype == torch.float32
    q.reset_amax()
    assert q.amax is None and q.global_amax is None


def test_modelopt_flat_block_layout_is_read():
    w = _weight((4, 32))
    q = calibrated(w)
    y = q(w)
    flat = calibrated(w)
    flat.reset_amax()
    flat.amax = q.amax.reshape(-1, 1)  # ModelOpt's (rows * blocks, 1)
    flat.global_amax = q.global_amax
    assert torch.equal(flat(w), y)


def test_ste_gradient():
    w = _weight((2, 32)).requires_grad_(True)
    q = calibrated(w.detach())
    a = q.amax.clone()
    a[0, 0] = a[0, 0] * 0.25  # elements of block (0, 0) above its range get no gradient
    q.amax = a
    q(w).sum().backward()
    ds = (mx.nvfp4_block_scales(w.detach(), mx.nvfp4_global_scale(q.global_amax), 16, a) *
          mx.nvfp4_global_scale(q.global_amax))  # fmt: skip
    top = (ds * 6).repeat_interleave(16, dim=-1)
    assert torch.equal(w.grad, (w.detach().abs() <= top).float())
    assert w.grad[0, :16].sum() < w.grad[0, 16:].sum()  # the clipped block lost some


@pytest.mark.parametrize("alg", ["awq_lite", {"method": "svdquant", "lowrank": 4, "progress": False}])
def test_weight_algorithms_run_on_static_weights(alg):
    import copy

    from torch import nn

    import modelopt_lite as mtq

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    cfg = {**copy.deepcopy(mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG), "algorithm": alg}
    mtq.quantize(model, cfg, lambda m: m(x))
    for i in (0, 2):
        q, w = model[i].weight_quantizer, model[i].weight.detach()
        assert q.is_nvfp4_static and tuple(q.amax.shape) == (w.shape[0], w.shape[1] // 16)
        assert torch.equal(q.amax, mx._block_amax(mx._blocks(w, 16)))  # max-calibrated on the final weight
        assert torch.equal(q.global_amax, w.abs().amax())
    with torch.no_grad():
        assert bool(torch.isfinite(model(x)).all())
