"""The tiny Llama decoder of the HF checkpoint tests, and the calibration that both sides (ours and
nvidia-modelopt, in ``tests/hf_reference/make_reference.py``) run on it.

The weights are set from integer draws divided by a power of two (exact on every CPU and independent of how
``transformers`` initialises a model), so tensors computed from the weights alone (weight codes and weight scales)
are the same everywhere; activation-derived values (input scales) are not compared against stored numbers.
"""

from __future__ import annotations

import hashlib

import torch
import transformers

VOCAB, HIDDEN, FFN = 128, 128, 256
#: the configs compared with ModelOpt's export (ModelOpt names; "+KV" adds the FP8 KV-cache entries)
CONFIGS = ("FP8_DEFAULT_CFG", "FP8_DEFAULT_CFG+KV", "NVFP4_DEFAULT_CFG", "INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG")
#: every config's weight-derived tensors are compared with ModelOpt's as stored digests; the AWQ configs run
#: with max calibration and the fixed :func:`awq_scales` on both sides (the AWQ searches differ)
VALUE_CONFIGS = CONFIGS
#: tensors computed from the weights alone (comparable as stored hashes)
WEIGHT_KEYS = (".weight", ".weight_scale", ".weight_scale_2", ".pre_quant_scale")


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A 2-layer Llama (hidden 128, 4 heads, 2 KV heads, FFN 256) in float32, eval mode, exact weights."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            codes = torch.randint(-1024, 1025, tuple(p.shape), generator=g).float()
            if name.endswith("norm.weight"):
                p.copy_(1.0 + codes / 8192.0)
            else:  # a different range per tensor (its amax), still exact: integers over a power of two
                p.copy_(codes * float(8 + i % 8) / 131072.0)
    return model


def awq_scales(model) -> dict[str, torch.Tensor]:
    """AWQ's result without its search: per Linear but the head, the weight divided by ``s`` now (in place), and
    ``s`` returned, to become the input quantizer's ``pre_quant_scale`` once quantized (powers of two: exact)."""
    g = torch.Generator().manual_seed(3)
    scales = {}
    with torch.no_grad():
        for n, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and n != "lm_head":
                scales[n] = 2.0 ** torch.randint(-2, 3, (m.weight.shape[1],), generator=g).float()
                m.weight.div_(scales[n].to(m.weight.dtype))
    return scales


def calib_data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(2)]


def forward_loop(model) -> None:
    with torch.no_grad():
        for x in calib_data():
            model(x)


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (float8 viewed as uint8)."""
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.view(torch.uint8)
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def layout(tensors: dict) -> dict:
    """``{key: [dtype, shape]}`` of a checkpoint's tensors."""
    return {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(tensors.items())}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :func:`layout` entry's name."""
    return getattr(torch, name)


def without_producer(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "producer"}


#: the SVDQuant export's rank in the tests (small: the tiny decoder's k/v projections have 64 rows)
SVD_RANK = 8


def svdquant_state(model, rank: int = SVD_RANK) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """SVDQuant's result without its search, on a float model: :func:`awq_scales` smooths every Linear but the head,
    then a float64 SVD of each smoothed weight gives ``a`` ``(rank, in)`` and ``b`` ``(out, rank)`` (float32) and the
    weight becomes the residual ``W - b @ a`` (in place). Returns ``{name: (pre_quant_scale, a, b)}``, to set on
    the quantized model (both sides then max-calibrate the residuals)."""
    out = {}
    with torch.no_grad():
        for name, s in awq_scales(model).items():
            lin = model.get_submodule(name)
            u, sv, vt = torch.linalg.svd(lin.weight.double(), full_matrices=False)
            a, b = vt[:rank].float(), (u[:, :rank] * sv[:rank]).float()
            lin.weight.sub_(b @ a)
            out[name] = (s, a, b)
    return out


def set_svdquant_state(model, state: dict) -> None:
    """Put :func:`svdquant_state`'s scales and factors on a quantized model (ours or ModelOpt's SVDQuant layers)."""
    for name, (s, a, b) in state.items():
        lin = model.get_submodule(name)
        lin.input_quantizer.pre_quant_scale = s
        lin.weight_quantizer.svdquant_lora_a = a
        lin.weight_quantizer.svdquant_lora_b = b
