"""auto_quantize on the real all-MiniLM-L6-v2 (issue 16's acceptance): per-layer {INT4 blocks of 128, INT8, float}.

Model and data as the MiniLM demo (``modelopt_lite/demo/minilm.py``): the mean-pooled encoder, ``--calib``
calibration sentences in batches of 32 (used to calibrate and to score, as ModelOpt's single ``data_loader``), and
the held-out retrieval set (48 query/passage pairs, 96 sentences) for the metric: the mean cosine similarity of
the embeddings to FP32's.

Rows: FP32; uniform INT4 (``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``, weight-only blocks of 128: 4 effective bits);
uniform INT8 (``INT8_DEFAULT_CFG``, W8A8: 8 bits, over the budget); ``auto_quantize`` at ``--bits`` (default 6)
with each score method (``--methods``; ``sensitivity`` and ``kl_div`` run the model once per layer, format and
batch: 288 runs here, long on a loaded machine); nvidia-modelopt's ``auto_quantize`` with ``gradient`` and
``kl_div`` (same formats, data, loss and logits) when importable.

Losses: ``"sensitivity"`` uses the squared distance of the embeddings to FP32's. That loss has a zero gradient at
the float model, so the gradient methods (ours and ModelOpt's) use it with the target sampled around the FP32
embedding (``fp32 + N(0, 1)``, fixed per batch): a sampled Fisher, whose expected score is the Gauss-Newton
diagonal of the plain distance. ``kl_div`` (ours and ModelOpt's) needs logits: in-batch retrieval logits, the
cosine of each embedding to every FP32 embedding of its batch times 20 (sentence-transformers' training scale),
so the score is the KL divergence of "which sentence of the batch is this" between float and quantized. ModelOpt
searches ``kl_div`` by bisection on the largest per-layer score, ours by the exact minimum of the total.
Run: ``PYTHONPATH=$PWD python bench/bench_auto_quantize.py``.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from run_all import cpu_model  # noqa: E402

import modelopt_lite as mtq  # noqa: E402
from modelopt_lite.algorithms.auto_quantize import format_table, layer_bits  # noqa: E402
from modelopt_lite.demo import measure  # noqa: E402
from modelopt_lite.demo.minilm import MAX_LENGTH, load_minilm  # noqa: E402
from modelopt_lite.demo.sentences import calibration_sentences, retrieval_pairs  # noqa: E402
from modelopt_lite.presets import PRESETS  # noqa: E402


def _tok(tok, texts):
    enc = tok(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def forward_step(model, batch):
    return model(**batch["inputs"])


def kl_forward_step(model, batch):
    """In-batch retrieval logits: 20 x the cosine of each embedding to every FP32 embedding of the batch."""
    e = torch.nn.functional.normalize(model(**batch["inputs"]), dim=-1)
    return 20 * e @ torch.nn.functional.normalize(batch["fp32"], dim=-1).T


def distance_loss(out, batch):
    return ((out - batch["fp32"]) ** 2).sum()


def fisher_loss(out, batch):
    return ((out - batch["fp32"] - batch["noise"]) ** 2).sum()


def cosine(model, feed, ref) -> float:
    with torch.no_grad():
        e = model(**feed)
    return float(torch.nn.functional.cosine_similarity(e.double(), ref.double(), dim=-1).mean())


def effective_bits(model) -> float:
    """Over every Linear of the encoder: sum(numel * bits) / sum(numel), float layers at 16 bits."""
    num = den = 0
    for _, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            n = m.weight.numel()
            den += n
            num += n * (layer_bits(m) if hasattr(m, "weight_quantizer") else 16)
    return num / den


def load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bits", type=float, default=6.0)
    p.add_argument("--calib", type=int, default=128, help="calibration/score sentences (batches of 32)")
    p.add_argument(
        "--methods",
        default="gradient,layer_error,sensitivity,kl_div",
        help="sensitivity and kl_div: 72 model runs per batch each",
    )
    p.add_argument("--peer-methods", default="gradient,kl_div", help="nvidia-modelopt's methods to run")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--no-uniform", action="store_true", help="skip the uniform INT4/INT8 rows")
    p.add_argument("--table", action="store_true", help="print the per-layer table of each search")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print(f"uptime at start: {load()} (shared machine: times are indicative)")

    with measure.quiet():
        tok, model = load_minilm()
    sents = calibration_sentences(args.calib)
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(0, len(sents), 32):
        inputs = _tok(tok, sents[i : i + 32])
        with torch.no_grad():
            fp32 = model(**inputs)
        batches.append({"inputs": inputs, "fp32": fp32, "noise": torch.randn(fp32.shape, generator=g)})
    pairs = retrieval_pairs()
    feed = _tok(tok, [q for q, _ in pairs] + [d for _, d in pairs])
    with torch.no_grad():
        ref = model(**feed)
    n = len(batches)
    loop = lambda m: [forward_step(m, b) for b in batches]  # noqa: E731
    formats = [mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, mtq.INT8_DEFAULT_CFG]
    rows = [("FP32", 16.0, 1.0, 0.0)]
    uniform = (("uniform INT4 (weight-only blocks 128)", formats[0]), ("uniform INT8 (W8A8)", formats[1]))
    for name, cfg in () if args.no_uniform else uniform:
        t0 = time.perf_counter()
        q = mtq.quantize(copy.deepcopy(model), cfg, loop)
        rows.append((name, effective_bits(q), cosine(q, feed, ref), time.perf_counter() - t0))
        print(f"done: {name}: cosine {rows[-1][2]:.5f}", flush=True)
    for method in [m for m in args.methods.split(",") if m]:
        t0 = time.perf_counter()
        q, st = mtq.auto_quantize(
            copy.deepcopy(model),
            {"effective_bits": args.bits},
            formats,
            batches,
            kl_forward_step if method == "kl_div" else forward_step,
            distance_loss if method == "sensitivity" else fisher_loss,
            num_calib_steps=n,
            num_score_steps=n,
            method=method,
        )
        dt = time.perf_counter() - t0
        choice = st["best"]["recipe"].values()
        counts = {
            f: sum(c == f for c in choice) for f in ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT8_DEFAULT_CFG", "NONE")
        }
        label = f"auto_quantize {method} ({counts['INT4_BLOCKWISE_WEIGHT_ONLY_CFG']} INT4 / "
        label += f"{counts['INT8_DEFAULT_CFG']} INT8 / {counts['NONE']} float)"
        rows.append((label, effective_bits(q), cosine(q, feed, ref), dt))
        print(f"done: {rows[-1][0]}: cosine {rows[-1][2]:.5f}, {dt:.1f} s", flush=True)
        if args.table:
            print(f"--- {method}\n{format_table(st)}", flush=True)
    if not args.no_peer:
        for method in [m for m in args.peer_methods.split(",") if m]:
            rows.append(_peer(model, formats, batches, feed, ref, args.bits, method))
            print(f"done: {rows[-1][0]}: cosine {rows[-1][2]:.5f}, {rows[-1][3]:.1f} s", flush=True)
    print(
        f"\nall-MiniLM-L6-v2, {len(sents)} calibration/score sentences, {len(pairs)} held-out pairs, budget {args.bits}"
    )
    print(f"{'variant':58} {'eff. bits':>9} {'mean cos':>9} {'seconds':>8}")
    for name, eb, cos, dt in rows:
        print(f"{name:58} {eb:9.3f} {cos:9.5f} {dt:8.1f}")
    print(f"uptime at end: {load()}")


def _peer(model, formats, batches, feed, ref, bits, method):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import modelopt.torch.quantization as mtq_peer
    except ImportError:
        return (f"nvidia-modelopt auto_quantize {method} (not installed)", float("nan"), float("nan"), 0.0)
    names = ["INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT8_DEFAULT_CFG"]
    assert [PRESETS[k] for k in names] == formats
    t0 = time.perf_counter()
    with warnings.catch_warnings(), measure.quiet():
        warnings.simplefilter("ignore")
        q, st = mtq_peer.auto_quantize(
            copy.deepcopy(model),
            {"effective_bits": bits},
            [getattr(mtq_peer, k) for k in names],
            batches,
            kl_forward_step if method == "kl_div" else forward_step,
            None if method == "kl_div" else fisher_loss,
            num_calib_steps=len(batches),
            num_score_steps=len(batches),
            method=method,
        )
    dt = time.perf_counter() - t0
    choice = [str(r).split("(")[0] for r in st["best"]["recipe"].values()]
    label = f"nvidia-modelopt {method} ({choice.count(names[0])} INT4 / {choice.count(names[1])} INT8 / "
    label += f"{choice.count('NONE')} float)"
    return (label, st["best"]["constraints"]["effective_bits"], cosine(q, feed, ref), dt)


if __name__ == "__main__":
    main()
