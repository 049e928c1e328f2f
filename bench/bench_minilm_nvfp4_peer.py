"""NVFP4 weight-only RTN on all-MiniLM-L6-v2: ModelOpt's CPU ``NVFP4QTensor`` beside modelopt_lite, same data.

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD python bench/bench_minilm_nvfp4_peer.py

Every ``nn.Linear`` weight of the encoder is quantized in blocks of 16 along its input axis with a per-tensor global
scale ``amax / (6 * 448)``: by ModelOpt's ``NVFP4QTensor.quantize``/``dequantize`` (its real quantization, which
runs on a CPU) and by ``W4A16_NVFP4_CFG``. Prints the mean/min cosine to the FP32 embeddings of the demo's held-out
retrieval set (48 query/passage pairs) and how many weight elements differ between the two.
"""

from __future__ import annotations

import copy
import os
import warnings

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import modelopt_lite as mtq
    from modelopt_lite.demo import minilm
    from modelopt_lite.demo.sentences import retrieval_pairs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

    tok, model = minilm.load_minilm()
    pairs = retrieval_pairs()
    enc = tok([q for q, _ in pairs] + [p for _, p in pairs], padding=True, truncation=True,
              max_length=minilm.MAX_LENGTH, return_tensors="pt", return_token_type_ids=False)  # fmt: skip
    feed = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    with torch.no_grad():
        ref = model(**feed)

    peer = copy.deepcopy(model).eval()
    peer_w = {}
    with torch.no_grad():
        for name, m in peer.named_modules():
            if isinstance(m, torch.nn.Linear):
                w = m.weight.detach().float()
                q, s, s2 = NVFP4QTensor.quantize(w.clone(), 16)
                m.weight.copy_(q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16}))
                peer_w[name] = m.weight.detach().clone()
        peer_emb = peer(**feed)

    ours = minilm._quantized(model, mtq.W4A16_NVFP4_CFG, [], False, "")
    diff = total = 0
    with torch.no_grad():
        ours_emb = ours(**feed)
        for name, m in ours.named_modules():
            if name in peer_w:
                w = m.weight_quantizer(m.weight)
                diff += int((w != peer_w[name]).sum())
                total += w.numel()
    for label, emb in (("ModelOpt NVFP4QTensor RTN", peer_emb), ("modelopt_lite W4A16_NVFP4_CFG", ours_emb)):
        cos = minilm._cos(emb, ref)
        print(f"| {label} | {float(cos.mean()):.5f} | {float(cos.min()):.4f} |")
    print(f"weight elements that differ: {diff} of {total}")


if __name__ == "__main__":
    main()
