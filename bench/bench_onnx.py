"""ONNX Runtime CPU latency: FP32 vs INT8 exports of modelopt_lite (the target="onnxruntime" layout and the
TensorRT-style graph), with the accuracy of each beside it.

Models:
- a wide MLP, ``MLP(512, 512, 10, depth=3)`` (three 512x512 Linear+ReLU, a 512->10 head), batch 1024. Its "accuracy"
  is the top-1 agreement with the FP32 model on 4096 random inputs (there is no dataset of that width);
- the digits CNN (``DigitsCNN``, trained), batch 64; accuracy on the digits test split.

Variants, all measured in the same run (interleaved):

- FP32 (the float export);
- ours, ``export_onnx(..., target="onnxruntime")`` (bit-identical to the torch model, ``requant="integer"``):
  ``INT8_ORT_CFG`` with uint8 weights (the default for 8-bit weights: ORT's u8 x u8 kernels, exact on every CPU);
  the same with int8 weights (``ort_weights="int8"``: ORT's u8 x s8 kernels, exact only on CPUs with VNNI/AMX, so
  measured only there); ``INT8_ORT_REDUCED_RANGE_CFG`` (7-bit weights stored as int8: the u8 x s8 kernels, exact on
  every CPU); each fast one also after ``modelopt_lite.share_relu_grids`` (ReLUs between quantizers run as uint8
  Clips). ``INT8_DEFAULT_CFG`` in the TensorRT layout for reference;
- ONNX Runtime's own ``onnxruntime.quantization.quantize_static`` on the same FP32 file and calibration batches:
  default settings (QDQ, int8 activations and weights, per tensor, MinMax), ``reduce_range=True``, and uint8
  weights (``activation_type=weight_type=QuantType.QUInt8``). They run with every ORT optimization on (as a user
  runs them); they have no torch twin, so their ``max|ORT-torch|`` is ``-``.

The top of the output names the CPU and its flags (AVX2, AVX-512, VNNI, AMX): int8 kernel speeds depend on them.
Each variant is run by ``ort_session`` (CPU provider, intra-op spinning off). Latencies are medians over
interleaved rounds (one run of every session per round), after warm-up. ``top1 vs FP32`` is the top-1 agreement with
the FP32 export; the CNN also shows test-set accuracy. ``max|ORT-torch|`` compares ORT's outputs with the torch model
they were exported from (0: bit-identical).

Usage: ``python bench/bench_onnx.py [--repeats 30] [--threads N] [--out DIR]``
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import onnx
import torch

import modelopt_lite as mtq
from modelopt_lite.examples import MLP, DigitsCNN, load_digits_data, train_classifier
from modelopt_lite.onnx_export import export_onnx
from modelopt_lite.onnx_export.ort_layout import host_has_vnni
from modelopt_lite.onnx_export.ort_runner import ort_session

FUSED = ("QGemm", "QLinearConv", "QLinearMatMul", "MatMulIntegerToFloat")


def export_fp32(model, sample, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            copy.deepcopy(model).eval(),
            (sample,),
            path,
            dynamo=False,
            input_names=["input"],
            dynamic_axes={"input": {0: "batch"}},
        )


def quantized(model, config, batches):
    q = copy.deepcopy(model)
    mtq.quantize(q, config, lambda m: [m(b) for b in batches])
    return q.eval()


class _Reader:
    """The calibration batches for ``quantize_static``."""

    def __init__(self, batches):
        self._it = iter([{"input": b.numpy()} for b in batches])

    def get_next(self):
        return next(self._it, None)


ORT_STATIC = {
    "ORT quantize_static, default": {},
    "ORT quantize_static, reduce_range": {"reduce_range": True},
    "ORT quantize_static, uint8 w": {"activation_type": "QUInt8", "weight_type": "QUInt8"},
}


def quantize_static_variants(fp32_path, batches, tmp, tag):
    """name -> ONNX path of ORT's own static quantization (settings in ``ORT_STATIC``)."""
    from onnxruntime.quantization import QuantType, quantize_static

    out = {}
    for i, (name, kw) in enumerate(ORT_STATIC.items()):
        kw = {k: getattr(QuantType, v) if k.endswith("_type") else v for k, v in kw.items()}
        path = os.path.join(tmp, f"{tag}_ort_static{i}.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_static(fp32_path, path, _Reader(batches), **kw)
        out[name] = path
    return out


def _export(q, sample, path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ort_weights="int8" warns that the file is VNNI-only: measured only there
        export_onnx(q, sample, path, target="onnxruntime", dynamic_axes={"input": {0: "batch"}}, **kw)
    return path


def build_variants(model, batches, sample, tmp, threads, tag):
    """name -> (session, file size, fused int8 ops in ORT's optimized graph, torch model or None)."""
    out = {}
    path = os.path.join(tmp, f"{tag}_fp32.onnx")
    export_fp32(model, sample, path)
    out["FP32"] = (path, model)
    calibrate = lambda m: [m(b) for b in batches]  # noqa: E731
    q8 = quantized(model, mtq.INT8_ORT_CFG, batches)
    q7 = quantized(model, mtq.INT8_ORT_REDUCED_RANGE_CFG, batches)
    out["ours: uint8 w (exact everywhere)"] = (_export(q8, sample, os.path.join(tmp, f"{tag}_u8.onnx")), q8)
    if host_has_vnni():
        path = _export(q8, sample, os.path.join(tmp, f"{tag}_s8.onnx"), ort_weights="int8")
        out["ours: int8 w (VNNI only)"] = (path, q8)
    out["ours: 7-bit w (exact everywhere)"] = (_export(q7, sample, os.path.join(tmp, f"{tag}_s7.onnx")), q7)
    for name, q, kw in [("ours: 7-bit w", q7, {}), ("ours: int8 w (VNNI only)", q8, {"ort_weights": "int8"})]:
        if "VNNI" in name and not host_has_vnni():
            continue
        shared = copy.deepcopy(q)
        if mtq.share_relu_grids(shared, calibrate):
            path = _export(shared, sample, os.path.join(tmp, f"{tag}_{len(out)}_shared.onnx"), **kw)
            out[f"{name.split(' (')[0]}, shared ReLU grids"] = (path, shared)
    qt = quantized(model, mtq.INT8_DEFAULT_CFG, batches)
    path = os.path.join(tmp, f"{tag}_int8_trt.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_onnx(qt, sample, path, target="tensorrt", dynamic_axes={"input": {0: "batch"}})
    out["ours: INT8 target=tensorrt"] = (path, qt)
    static = quantize_static_variants(out["FP32"][0], batches, tmp, tag)
    sessions = {}
    for name, (path, module) in [*out.items(), *((n, (p, None)) for n, p in static.items())]:
        opt = path + ".opt.onnx"
        # ORT's own files run with every fusion on, as ORT users run them (exact=False)
        sess = ort_session(path, threads=threads, spinning=False, optimized_model_path=opt, exact=module is not None)
        fused = sum(n.op_type in FUSED for n in onnx.load(opt).graph.node)
        sessions[name] = (sess, os.path.getsize(path), fused, module)
    return sessions


def time_interleaved(sessions, x: np.ndarray, repeats: int) -> dict[str, float]:
    feeds = {name: {s.get_inputs()[0].name: x} for name, (s, *_) in sessions.items()}
    for name, (s, *_) in sessions.items():  # warm-up
        for _ in range(3):
            s.run(None, feeds[name])
    times = {name: [] for name in sessions}
    for _ in range(repeats):
        for name, (s, *_) in sessions.items():
            t = time.perf_counter()
            s.run(None, feeds[name])
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def top1(sess, x: np.ndarray, batch: int) -> np.ndarray:
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: x[i : i + batch]})[0].argmax(1) for i in range(0, len(x), batch)])


def max_diff(sessions, x: np.ndarray) -> dict[str, float]:
    """max |ORT output - torch output| of every variant on ``x`` (0.0: bit-identical)."""
    out = {}
    for name, (sess, _, _, module) in sessions.items():
        if module is None:
            continue
        got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        out[name] = float(np.abs(got - want).max())
    return out


def table(title, sessions, ms, agree, diff, acc=None):
    fp_ms = ms["FP32"]
    head = f"{'variant':<42}{'median ms':>10}{'speedup':>9}{'size KiB':>10}{'int8 ops':>9}{'top1 vs FP32':>14}"
    head += f"{'accuracy':>10}" if acc else ""
    lines = [title, head + f"{'max|ORT-torch|':>16}"]
    for name, (_, size, fused, _) in sessions.items():
        line = (
            f"{name:<42}{ms[name]:>10.3f}{fp_ms / ms[name]:>8.2f}x{size / 1024:>10.1f}{fused:>9}{agree[name]:>13.2f}%"
        )
        line += f"{acc[name]:>9.2f}%" if acc else ""
        lines.append(line + (f"{diff[name]:>16.3g}" if name in diff else f"{'-':>16}"))
    return "\n".join(lines)


def agreement(sessions, x: np.ndarray, batch: int) -> dict[str, float]:
    """Top-1 agreement (percent) of every variant with the FP32 export on ``x``."""
    ref = top1(sessions["FP32"][0], x, batch)
    return {n: 100.0 * float((top1(s, x, batch) == ref).mean()) for n, (s, *_) in sessions.items()}


def bench_mlp(tmp, repeats, threads):
    torch.manual_seed(0)
    model = MLP(512, 512, 10, depth=3).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(256, 512, generator=g) for _ in range(4)]
    x = torch.randn(1024, 512, generator=g).numpy()
    evalx = torch.randn(4096, 512, generator=g).numpy()
    sessions = build_variants(model, calib, torch.from_numpy(x[:8]), tmp, threads, "mlp")
    ms = time_interleaved(sessions, x, repeats)
    return table(
        "MLP(512, 512, 10, depth=3), batch 1024, input 1024x512; top-1 agreement on 4096 random inputs",
        sessions,
        ms,
        agreement(sessions, evalx, 1024),
        max_diff(sessions, evalx),
    )


def fold_batchnorm(model: DigitsCNN) -> DigitsCNN:
    """Conv-BN pairs folded into the convs (the usual deployment step; ORT folds them in FP32 too)."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    m = copy.deepcopy(model).eval()
    m.conv1, m.bn1 = fuse_conv_bn_eval(m.conv1, m.bn1), torch.nn.Identity()
    m.conv2, m.bn2 = fuse_conv_bn_eval(m.conv2, m.bn2), torch.nn.Identity()
    return m


def bench_cnn(tmp, repeats, threads, c1=16, c2=32):
    data = load_digits_data()
    torch.manual_seed(0)
    model = train_classifier(DigitsCNN(c1, c2), data.x_train, data.y_train, epochs=15).eval()
    model = fold_batchnorm(model)
    sessions = build_variants(model, data.calib_batches(8, 64), data.x_test[:8], tmp, threads, f"cnn{c1}")
    x = data.x_test[:64].numpy()
    ms = time_interleaved(sessions, x, repeats)
    y, xt = data.y_test.numpy(), data.x_test.numpy()
    acc = {n: 100.0 * float((top1(s, xt, 64) == y).mean()) for n, (s, *_) in sessions.items()}
    return table(
        f"DigitsCNN(c1={c1}, c2={c2}) (1x8x8 -> Conv{c1} -> Conv{c2}/2 -> Linear, BN folded), batch 64; "
        f"top-1 agreement and accuracy on the {len(y)} test images",
        sessions,
        ms,
        agreement(sessions, xt, 64),
        max_diff(sessions, xt),
        acc,
    )


def cpu_line() -> str:
    """The CPU model and the flags that decide ORT's int8 kernels (Linux /proc/cpuinfo, else platform)."""
    import platform

    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    vnni = "VNNI: yes" if host_has_vnni() else "VNNI: no (int8-weight rows with full-range weights not exact here)"
    return f"CPU: {name}, {os.cpu_count()} logical CPUs; flags: {', '.join(shown) or 'none of avx2/avx512/vnni/amx'}; {vnni}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: ORT's choice)")
    p.add_argument("--out", default=None, help="keep the ONNX files in this folder")
    args = p.parse_args(argv)
    import onnxruntime

    print(cpu_line())
    print(
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs, "
        f"threads={args.threads or 'default'}, spinning off, medians of {args.repeats} interleaved rounds"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or tmp
        os.makedirs(folder, exist_ok=True)
        print(bench_mlp(folder, args.repeats, args.threads), flush=True)
        print(bench_cnn(folder, args.repeats, args.threads), flush=True)
        print(bench_cnn(folder, args.repeats, args.threads, 64, 128), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
