"""NVFP4 against ModelOpt's CPU real quantization (``NVFP4QTensor.quantize``/``dequantize``), when installed.

Both compute ``ds = s * gs`` and divide ``x / ds`` (ModelOpt's CPU qtensor divides too, so no element differs by a
reciprocal's rounding); E2M1 rounding is round-half-to-even in both. The one documented difference: a block whose
E4M3 scale rounds to 0 (block amax below ~2**-18.8 of the tensor's amax) is dead for us (zeros, as numerics.md
says), while ModelOpt clamps its scale up to 2**-9 and quantizes it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from modelopt_lite.functional import microscaling as mx

pytest.importorskip("modelopt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from modelopt.torch.quantization.qtensor import NVFP4QTensor


def _peer(x: torch.Tensor, gs: torch.Tensor, block: int):
    q, s, s2 = NVFP4QTensor.quantize(x.clone(), block, weights_scaling_factor_2=gs.clone())
    y = q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: block})
    return q._quantized_data, s, y


@pytest.mark.parametrize("scale", [1.0, 1e-3, 3e-6, 1e4])
@pytest.mark.parametrize("block", [16, 32])
def test_nvfp4_matches_modelopt_cpu_qtensor(scale, block):
    g = torch.Generator().manual_seed(int(scale * 1000) % 97 + block)
    x = torch.randn(32, 128, generator=g) * scale
    x[:, :block] *= 0.01  # smaller blocks beside large ones (scales well inside E4M3's range)
    gs = mx.nvfp4_global_scale(x.abs().amax())
    packed, s, y = _peer(x, gs, block)
    codes, scales = mx.quantize_nvfp4(x, gs, block)
    assert torch.equal(scales.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal((codes[..., 1::2] << 4) | codes[..., 0::2], packed)
    assert torch.equal(mx.fake_nvfp4(x, gs, block), y)


def test_nvfp4_tiny_block_is_dead_for_us_clamped_by_modelopt():
    x = torch.zeros(1, 32)
    x[0, :16] = 1.0
    x[0, 16:] = 1e-6  # block scale 448 * 1e-6 rounds to 0 in E4M3
    gs = mx.nvfp4_global_scale(x.abs().amax())
    _, s, y = _peer(x, gs, 16)
    assert s.float()[0, 1].item() == 2.0**-9  # ModelOpt's clamp
    assert y[0, 16:].ne(0).all()
    ours = mx.fake_nvfp4(x, gs)
    assert torch.equal(ours[0, 16:], torch.zeros(16)) and torch.equal(ours[0, :16], y[0, :16])


@pytest.mark.parametrize(
    "name",
    ["NVFP4_DEFAULT_CFG", "W4A16_NVFP4_CFG", "W4A8_NVFP4_FP8_CFG", "MXFP8_DEFAULT_CFG", "MXFP4_DEFAULT_CFG",
     "MXINT8_DEFAULT_CFG"],
)  # fmt: skip
def test_presets_carry_modelopts_quant_cfg(name):
    from modelopt.torch.quantization import config as peer_config

    from modelopt_lite.presets import mx as presets_mx

    peer = getattr(peer_config, name)
    ours = getattr(presets_mx, name)
    assert ours["algorithm"] == peer["algorithm"]
    entries = {e["quantizer_name"]: e for e in peer["quant_cfg"]}
    for key in ("*weight_quantizer", "*input_quantizer"):
        mine = ours["quant_cfg"][key]
        if key not in entries:
            assert mine == {"enable": False}
            continue
        cfg = dict(entries[key]["cfg"])
        cfg.pop("effective_bits", None)  # informational in ModelOpt
        assert {k: mine[k] for k in cfg} == cfg
        assert mine["enable"] is True and mine.get("axis") is None
