"""Shared by the attention tests: the fake quantization written out, a reference attention, input capture."""

from __future__ import annotations

import torch

from modelopt_lite.nn import ATTENTION_QUANTIZERS


def fake_int8(x: torch.Tensor, q) -> torch.Tensor:
    """The numerics contract, written out: scale = amax / 127, round half to even, clamp, dequantize (``x`` itself
    when ``q`` is disabled)."""
    if not q.is_enabled:
        return x
    scale = q.amax.float() / 127.0
    lo = -127 if q.quant_desc.narrow_range else -128
    return torch.clamp(torch.round(x / scale), lo, 127) * scale


def reference(qm, q, k_t, v, scale, mask=None):
    """softmax_q(softmax(q_bmm(Q) @ k_bmm(K^T) * scale + mask)) @ v_bmm(V), fake quantization done here."""
    s = torch.matmul(fake_int8(q, qm.q_bmm_quantizer), fake_int8(k_t, qm.k_bmm_quantizer)) * scale
    if mask is not None:
        s = s + mask
    p = fake_int8(torch.softmax(s, dim=-1), qm.softmax_quantizer)
    return torch.matmul(p, fake_int8(v, qm.v_bmm_quantizer)), p


def capture_inputs(module):
    """Forward hooks recording what each attention quantizer received (the tensors the matmuls are fed from)."""
    seen = {}
    hooks = [
        getattr(module, n).register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, (i[0], o)))
        for n in ATTENTION_QUANTIZERS
    ]
    return seen, hooks
