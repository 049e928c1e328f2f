"""GPTQ on all-MiniLM-L6-v2: ours vs nvidia-modelopt 0.47's, INT4 weights in blocks of 128, activations float.

Setup as the MiniLM demo (``modelopt_lite/demo/minilm.py``): 256 built-in calibration sentences in batches of 32
(max 64 tokens), metric = mean cosine similarity of the mean-pooled embeddings to FP32 on the held-out retrieval
set (96 sentences). Reported: the CPU, the load average before and after, round-to-nearest (max calibration), our
GPTQ (``{"method": "gptq"}``, default ``perc_damp=0.01, block_size=128``; ``--desc-act`` and ``--clip-search``
add those variants) and, in
the same run when ``modelopt`` is importable, ModelOpt's GPTQ (``INT4_BLOCKWISE_WEIGHT_ONLY_CFG`` with
``"algorithm": {"method": "gptq"}``). Times are wall-clock seconds of ``quantize`` (calibration passes included).

Run: ``PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python bench/bench_gptq.py [--threads N] [--desc-act] [--clip-search]
[--calib N] [--no-peer]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import modelopt_lite as mtq
from modelopt_lite.conversion.model_quant import make_forward_loop
from modelopt_lite.demo.minilm import MAX_LENGTH, load_minilm
from modelopt_lite.demo.sentences import calibration_sentences, retrieval_pairs


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "?"


def _data(tok, n_calib):
    calib = calibration_sentences(n_calib)
    enc = dict(return_tensors="pt", padding=True, truncation=True, max_length=MAX_LENGTH, return_token_type_ids=False)
    batches = [dict(tok(calib[i : i + 32], **enc)) for i in range(0, len(calib), 32)]
    pairs = retrieval_pairs()
    feed = dict(tok([q for q, _ in pairs] + [p for _, p in pairs], **enc))
    return batches, feed


def _cos(model, feed, ref) -> float:
    with torch.no_grad():
        emb = model(**feed)
    return float(torch.nn.functional.cosine_similarity(emb.double(), ref.double(), dim=-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--desc-act", action="store_true", help="also run ours with act-order")
    ap.add_argument("--clip-search", action="store_true", help="also run ours with clip_search")
    ap.add_argument("--calib", type=int, default=256, help="calibration sentences (default 256, as the demo)")
    ap.add_argument("--no-peer", action="store_true", help="skip nvidia-modelopt")
    ap.add_argument("--peer-only", action="store_true", help="only nvidia-modelopt (and no RTN row)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok, model = load_minilm()
    batches, feed = _data(tok, args.calib)
    with torch.no_grad():
        ref = model(**feed)
    print(f"CPU: {_cpu()}, torch threads {torch.get_num_threads()}, load average before: {_load()}", flush=True)
    loop = make_forward_loop(batches)
    rows = []

    def ours(name, algorithm):
        q = copy.deepcopy(model)
        cfg = {**copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG), "algorithm": algorithm}
        t = time.perf_counter()
        mtq.quantize(q, cfg, loop)
        rows.append((name, time.perf_counter() - t, _cos(q, feed, ref)))
        print(f"  {name}: {rows[-1][1]:.1f} s, cosine {rows[-1][2]:.4f}", flush=True)

    if not args.peer_only:
        ours("modelopt_lite RTN (max)", "max")
        ours("modelopt_lite GPTQ", {"method": "gptq"})
    if args.desc_act and not args.peer_only:
        ours("modelopt_lite GPTQ desc_act", {"method": "gptq", "desc_act": True})
    if args.clip_search and not args.peer_only:
        ours("modelopt_lite GPTQ clip_search", {"method": "gptq", "clip_search": True})
    if args.clip_search and args.desc_act and not args.peer_only:
        ours("modelopt_lite GPTQ desc_act clip_search", {"method": "gptq", "desc_act": True, "clip_search": True})
    if not args.no_peer:
        try:
            import modelopt.torch.quantization as mtq_peer
        except ImportError:
            print("nvidia-modelopt not importable: peer rows skipped")
        else:
            q = copy.deepcopy(model)
            cfg = {**copy.deepcopy(mtq_peer.INT4_BLOCKWISE_WEIGHT_ONLY_CFG), "algorithm": {"method": "gptq"}}

            def peer_loop(m):
                with torch.no_grad():
                    for b in batches:
                        m(**b)

            t = time.perf_counter()
            mtq_peer.quantize(q, cfg, peer_loop)
            rows.append(("ModelOpt 0.47 GPTQ", time.perf_counter() - t, _cos(q, feed, ref)))
            print(f"  ModelOpt 0.47 GPTQ: {rows[-1][1]:.1f} s, cosine {rows[-1][2]:.4f}", flush=True)
    print(f"load average after: {_load()}")
    print("| method | quantize s | mean cosine to FP32 |")
    print("|:--|--:|--:|")
    for name, sec, cos in rows:
        print(f"| {name} | {sec:.1f} | {cos:.4f} |")


if __name__ == "__main__":
    main()
