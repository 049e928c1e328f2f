"""ModelOpt 0.47's scale-search entry points beside ours, same model and data, on the CPU.

Run with the peer's venv: ``/tmp/venv-peer/bin/python bench/bench_model_calib_peer.py`` (from the repository root).
A 3-layer MLP (256 -> 256 -> 256 -> 64, heavy-tailed weights), INT4 weights per channel or in static blocks of 16,
activations off; 8 batches of 64 correlated inputs. For each method: the summed squared weight error and the
layer-output error ``sum ||X W^T - X q(W)^T||^2`` over the calibration inputs (each layer fed the float model's
activations), both measured with our quantizer on each side's amaxes, the share of amax entries equal to ours, and
the wall time of the calibration call.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import modelopt.torch.quantization as peer_mtq  # noqa: E402

import modelopt_lite as ours  # noqa: E402
from modelopt_lite import model_calib  # noqa: E402

W4 = {"num_bits": 4, "axis": 0}
B16 = {"num_bits": 4, "block_sizes": {-1: 16, "type": "static"}}


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )
    with torch.no_grad():
        for i in (0, 2, 4):
            m[i].weight.copy_(torch.randn_like(m[i].weight) ** 3 * 0.02)
    return m


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    scale = torch.logspace(-1, 0.5, 256)
    return [torch.randn(64, 256, generator=g) * scale + 0.5 * torch.randn(64, 1, generator=g) for _ in range(8)]


def loop(m) -> None:
    for x in batches():
        m(x)


def layer_inputs(model) -> dict[int, torch.Tensor]:
    ref = make()
    out: dict[int, list] = {0: [], 2: [], 4: []}
    hooks = [ref[i].register_forward_pre_hook(lambda _m, a, i=i: out[i].append(a[0])) for i in out]
    with torch.no_grad():
        loop(ref)
    for h in hooks:
        h.remove()
    return {i: torch.cat(v) for i, v in out.items()}


def errors(model, amaxes: dict[int, torch.Tensor], xs: dict[int, torch.Tensor]) -> tuple[float, float]:
    w_err = o_err = 0.0
    for i, a in amaxes.items():
        q = copy.deepcopy(model[i].weight_quantizer)
        q.amax = a.reshape(q.amax.shape)
        w = model[i].weight.detach()
        dw = w - q(w)
        w_err += float((dw**2).sum())
        o_err += float(((xs[i] @ dw.T) ** 2).sum())
    return w_err, o_err


def run(weight: dict, method: str, params: dict) -> None:
    ours_cfg = {"quant_cfg": {"*": {"enable": False}, "*weight_quantizer": {**weight, "enable": True}}}
    peer_cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": weight, "enable": True},
        ],
        "algorithm": {"method": method, **params} if method != "max" else "max",
    }
    mine = ours.quantize(make(), ours_cfg, loop)
    t0 = time.perf_counter()
    if method == "mse":
        model_calib.mse_calibrate(mine, loop, **params)
    elif method == "local_hessian":
        model_calib.local_hessian_calibrate(mine, loop, **params)
    t_ours = time.perf_counter() - t0
    peer = make()
    t0 = time.perf_counter()
    peer_mtq.quantize(peer, peer_cfg, loop)
    t_peer = time.perf_counter() - t0
    xs = layer_inputs(mine)
    a_ours = {i: mine[i].weight_quantizer.amax for i in (0, 2, 4)}
    a_peer = {i: peer[i].weight_quantizer.amax.float().reshape(a_ours[i].shape) for i in (0, 2, 4)}
    same = sum(int((a_ours[i] == a_peer[i]).sum()) for i in a_ours) / sum(a.numel() for a in a_ours.values())
    wo, oo = errors(mine, a_ours, xs)
    wp, op = errors(mine, a_peer, xs)
    name = "int4-per-channel" if weight is W4 else "int4-block16"
    print(
        f"{name:17s} {method:14s} ours: weight {wo:.5f} output {oo:10.4f} ({t_ours:5.2f} s) | "
        f"ModelOpt: weight {wp:.5f} output {op:10.4f} (quantize {t_peer:5.2f} s) | same amax {same:.1%}"
    )


def main() -> None:
    print(f"torch {torch.__version__}, nvidia-modelopt {getattr(peer_mtq, '__version__', '0.47')}, CPU")
    for weight in (W4, B16):
        run(weight, "max", {})
        run(weight, "mse", {})
        run(weight, "local_hessian", {"fp8_scale_sweep": False, "block_size": 16})


if __name__ == "__main__":
    main()
