"""Weight algorithms on all-MiniLM-L6-v2: ours vs nvidia-modelopt's, time and accuracy, measured in the same run.

Every row quantizes a fresh copy of the float model (INT4 weights in blocks of 128 along the input axis, activations
float) calibrated on the demo's calibration sentences, and reports the wall time of ``quantize`` (calibration and
search included) and the mean / min cosine similarity of the mean-pooled embeddings to FP32 on the demo's held-out
sentences (96: 48 query/passage pairs). The peer columns are filled when ``modelopt`` is importable.

Rows are :data:`ROWS`, a list of ``(name, ours_fn, peer_fn)``; each function takes ``(model, forward_loop)``,
quantizes ``model`` in place and returns it (peer_fn may be None). Add an algorithm by appending a row.

Run: ``PYTHONPATH=$PWD python3 bench/bench_weight_algorithms.py [--calib 256] [--rows RTN,AWQ]``. The machine may be
shared: the load average is printed with the results; compare times only within one run.
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
sys.path.insert(0, ROOT)

import modelopt_lite as mtq
from modelopt_lite.demo import measure
from modelopt_lite.demo.minilm import MAX_LENGTH, load_minilm
from modelopt_lite.demo.sentences import calibration_sentences, retrieval_pairs


def _peer():
    try:
        with measure.quiet():
            import modelopt.torch.quantization as mtq_peer
    except ImportError:
        return None
    return mtq_peer


PEER = _peer()


def _with_algorithm(cfg: dict, algorithm) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["algorithm"] = algorithm
    return cfg


# --- rows: (model, forward_loop) -> quantized model ----------------------------------------------------------------
def ours_rtn(model, loop):
    return mtq.quantize(model, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, loop)


def peer_rtn(model, loop):
    return PEER.quantize(model, _with_algorithm(PEER.INT4_AWQ_CFG, "max"), loop)


def ours_awq_lite(model, loop):
    return mtq.quantize(model, _with_algorithm(mtq.INT4_AWQ_CFG, {"method": "awq_lite", "progress": False}), loop)


def peer_awq_lite(model, loop):
    return PEER.quantize(model, PEER.INT4_AWQ_CFG, loop)


def ours_awq_full(model, loop):
    return mtq.quantize(model, _with_algorithm(mtq.INT4_AWQ_CFG, {"method": "awq_full", "progress": False}), loop)


def peer_awq_full(model, loop):
    return PEER.quantize(model, _with_algorithm(PEER.INT4_AWQ_CFG, {"method": "awq_full"}), loop)


def ours_awq_gptq(model, loop):
    from modelopt_lite.demo.minilm import INT4_BEST_ALGORITHM

    steps = [dict(st, progress=False) if st["method"].startswith("awq") else st for st in INT4_BEST_ALGORITHM]
    return mtq.quantize(model, _with_algorithm(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, steps), loop)


def peer_awq_gptq(model, loop):
    # ModelOpt 0.47 takes the same list form; its GPTQ has no clip_search/scale_refit (its defaults)
    return PEER.quantize(model, _with_algorithm(PEER.INT4_AWQ_CFG, ["awq_lite", {"method": "gptq"}]), loop)


#: (name, ours, peer): every row of the table; append to add an algorithm
ROWS = [
    ("RTN (max)", ours_rtn, peer_rtn),
    ("AWQ lite (INT4_AWQ_CFG)", ours_awq_lite, peer_awq_lite),
    ("AWQ full (lite + clip)", ours_awq_full, peer_awq_full),
    ("AWQ lite, then GPTQ (list)", ours_awq_gptq, peer_awq_gptq),
]


# --- harness -------------------------------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def data(tok, n_calib: int):
    calib = calibration_sentences(n_calib)
    kw = dict(padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt", return_token_type_ids=False)
    batches = [dict(tok(calib[i : i + 32], **kw)) for i in range(0, len(calib), 32)]
    pairs = retrieval_pairs()
    enc = tok([q for q, _ in pairs] + [p for _, p in pairs], **kw)
    return batches, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def measure_row(fn, model, batches, feed, ref):
    q = copy.deepcopy(model).eval()

    def loop(m):
        with torch.no_grad():
            for b in batches:
                m(**b)

    t0 = time.perf_counter()
    with measure.quiet():
        q = fn(q, loop)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        cos = torch.nn.functional.cosine_similarity(q(**feed).double(), ref.double(), dim=-1)
    return seconds, float(cos.mean()), float(cos.min())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=int, default=256, help="calibration sentences (batches of 32)")
    ap.add_argument("--rows", default=None, help="comma-separated row name prefixes to run (default: all)")
    args = ap.parse_args(argv)
    with measure.quiet():
        tok, model = load_minilm()
    batches, feed = data(tok, args.calib)
    with torch.no_grad():
        ref = model(**feed)
    print(f"CPU: {cpu_name()}; torch threads: {torch.get_num_threads()}; load average at start: {os.getloadavg()}")
    print(
        f"all-MiniLM-L6-v2, INT4 blocks of 128, {args.calib} calibration sentences, {feed['input_ids'].shape[0]} "
        f"held-out sentences; modelopt {'not importable' if PEER is None else 'importable'}"
    )
    head = f"| {'algorithm':<26} | {'ours s':>7} | {'ours cos mean/min':>17} |"
    if PEER is not None:
        head += f" {'ModelOpt s':>10} | {'ModelOpt cos mean/min':>21} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    wanted = None if args.rows is None else [w.strip() for w in args.rows.split(",")]
    for name, ours, peer in ROWS:
        if wanted is not None and not any(name.startswith(w) for w in wanted):
            continue
        s, cm, cn = measure_row(ours, model, batches, feed, ref)
        line = f"| {name:<26} | {s:7.2f} | {cm:.5f} / {cn:.4f} |"
        if PEER is not None and peer is not None:
            ps, pm, pn = measure_row(peer, model, batches, feed, ref)
            line += f" {ps:10.2f} | {pm:.5f} / {pn:.4f}      |"
        print(line, flush=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
