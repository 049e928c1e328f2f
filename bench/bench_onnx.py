"""ONNX Runtime CPU latency: FP32 vs INT8 exports of modelopt_lite (the target="onnxruntime" layout and the
TensorRT-style graph), with the accuracy of each beside it.

Models:
- a wide MLP, ``MLP(512, 512, 10, depth=3)`` (three 512x512 Linear+ReLU, a 512->10 head), batch 1024. Its "accuracy"
  is the top-1 agreement with the FP32 model on 4096 random inputs (there is no dataset of that width);
- the digits CNN (``DigitsCNN``, trained), batch 64; accuracy on the digits test split.

Variants: FP32; INT8 ``INT8_ORT_CFG`` exported with ``target="onnxruntime"`` and int8 weights (ORT's u8 x s8 kernels,
exact on CPUs with VNNI/AMX), the same with uint8 weights (u8 x u8, exact everywhere), the same after
``modelopt_lite.share_relu_grids`` (ReLUs between quantizers run as uint8 Clips); INT8 ``INT8_DEFAULT_CFG`` in the
TensorRT layout. Each variant is exported with ``export_onnx`` and run by ``ort_session`` (CPU provider, intra-op spinning off).
Latencies are medians over interleaved rounds (one run of every session per round), after warm-up. The column
``max|ORT-torch|`` compares ORT's outputs with the torch model they were exported from, on the accuracy inputs
(``INT8_ORT_CFG`` sets ``requant="integer"``, so those rows are 0: bit-identical).

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


def build_variants(model, batches, sample, tmp, threads, tag):
    """name -> (session, file size, fused int8 ops in ORT's optimized graph)."""
    out = {}
    path = os.path.join(tmp, f"{tag}_fp32.onnx")
    export_fp32(model, sample, path)
    out["FP32"] = (path, model)
    q = quantized(model, mtq.INT8_ORT_CFG, batches)
    for weights in ("int8", "uint8"):
        path = os.path.join(tmp, f"{tag}_int8_ort_{weights}.onnx")
        export_onnx(q, sample, path, target="onnxruntime", ort_weights=weights, dynamic_axes={"input": {0: "batch"}})
        out[f"INT8 onnxruntime, {weights} w"] = (path, q)
    shared = copy.deepcopy(q)
    if mtq.share_relu_grids(shared, lambda m: [m(b) for b in batches]):
        path = os.path.join(tmp, f"{tag}_int8_ort_shared.onnx")
        export_onnx(
            shared, sample, path, target="onnxruntime", ort_weights="int8", dynamic_axes={"input": {0: "batch"}}
        )
        out["INT8 onnxruntime, int8 w, shared ReLU grids"] = (path, shared)
    q = quantized(model, mtq.INT8_DEFAULT_CFG, batches)
    path = os.path.join(tmp, f"{tag}_int8_trt.onnx")
    export_onnx(q, sample, path, target="tensorrt", dynamic_axes={"input": {0: "batch"}})
    out["INT8 target=tensorrt"] = (path, q)
    sessions = {}
    for name, (path, module) in out.items():
        opt = path + ".opt.onnx"
        sess = ort_session(path, threads=threads, spinning=False, optimized_model_path=opt)
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
        got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        out[name] = float(np.abs(got - want).max())
    return out


def table(title, sessions, ms, acc_of, acc_label, diff):
    fp_ms, fp_acc = ms["FP32"], acc_of["FP32"]
    lines = [
        title,
        (
            f"{'variant':<44}{'median ms':>10}{'speedup':>9}{'size KiB':>10}{'int8 ops':>9}"
            f"{acc_label:>14}{'drop':>8}{'max|ORT-torch|':>16}"
        ),
    ]
    for name, (_, size, fused, _) in sessions.items():
        lines.append(
            f"{name:<44}{ms[name]:>10.2f}{fp_ms / ms[name]:>8.2f}x{size / 1024:>10.1f}{fused:>9}"
            f"{acc_of[name]:>13.2f}%{fp_acc - acc_of[name]:>+8.2f}{diff[name]:>16.3g}"
        )
    return "\n".join(lines)


def bench_mlp(tmp, repeats, threads):
    torch.manual_seed(0)
    model = MLP(512, 512, 10, depth=3).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(256, 512, generator=g) for _ in range(4)]
    x = torch.randn(1024, 512, generator=g).numpy()
    evalx = torch.randn(4096, 512, generator=g).numpy()
    sessions = build_variants(model, calib, torch.from_numpy(x[:8]), tmp, threads, "mlp")
    ms = time_interleaved(sessions, x, repeats)
    ref = top1(sessions["FP32"][0], evalx, 1024)
    agree = {n: 100.0 * float((top1(s, evalx, 1024) == ref).mean()) for n, (s, *_) in sessions.items()}
    return table(
        "MLP(512, 512, 10, depth=3), batch 1024, input 1024x512",
        sessions,
        ms,
        agree,
        "top1 vs FP32",
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
    y = data.y_test.numpy()
    acc = {n: 100.0 * float((top1(s, data.x_test.numpy(), 64) == y).mean()) for n, (s, *_) in sessions.items()}
    return table(
        f"DigitsCNN(c1={c1}, c2={c2}) (1x8x8 -> Conv{c1} -> Conv{c2}/2 -> Linear, BN folded), batch 64",
        sessions,
        ms,
        acc,
        "accuracy",
        max_diff(sessions, data.x_test.numpy()),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: ORT's choice)")
    p.add_argument("--out", default=None, help="keep the ONNX files in this folder")
    args = p.parse_args(argv)
    import onnxruntime

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
