"""Regenerate ``modelopt_reference.json``: nvidia-modelopt's own unified HF export of ``tests/hf_helpers.tiny_llama``.

Run from the repository root with the pinned peer (nvidia-modelopt 0.47.0, CPU)::

    /tmp/venv-peer/bin/python tests/hf_reference/make_reference.py

For every config of ``hf_helpers.CONFIGS`` it stores the tensors' keys, dtypes and shapes, the ``quantization``
section of ``hf_quant_config.json`` and ``config.json``'s ``quantization_config`` (producer left out), and for the
configs of ``hf_helpers.VALUE_CONFIGS`` a digest of every tensor computed from the weights alone. The AWQ configs
are calibrated with max and the fixed ``hf_helpers.awq_scales`` as their ``pre_quant_scale`` (ModelOpt's AWQ search
and ours differ; the export is what is compared). ``NVFP4_SVDQUANT_DEFAULT_CFG`` is ModelOpt's SVDQuant layers with
``hf_helpers.svdquant_state`` (see ``SVD`` below).
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import hf_helpers as H  # noqa: E402

#: NVFP4 SVDQuant: the NVFP4 quantizers (max) with hf_helpers.svdquant_state's scales and factors (no search); its
#: weights depend on a float64 SVD (LAPACK: not bit-stable across CPUs), so it is stored without digests
SVD = "NVFP4_SVDQUANT_DEFAULT_CFG"


def peer_svdquant():
    """ModelOpt's SVDQuant layers holding hf_helpers.svdquant_state (its NVFP4 svdquant search needs CUDA)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.conversion import create_and_replace_svdquant_linear_on_the_fly

    model = H.tiny_llama()
    state = H.svdquant_state(model)
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, H.forward_loop)
    create_and_replace_svdquant_linear_on_the_fly(model)
    H.set_svdquant_state(model, state)
    return model


def peer_config(mtq, name: str) -> dict:
    base = getattr(mtq, name.removesuffix("+KV"))
    cfg = {"quant_cfg": list(base["quant_cfg"]), "algorithm": base["algorithm"]}
    if name.endswith("+KV"):
        cfg["quant_cfg"] += mtq.FP8_KV_CFG["quant_cfg"]
    if "AWQ" in name:
        cfg["algorithm"] = "max"  # with hf_helpers.awq_scales in place of the search
    return cfg


def peer_export(name: str, out: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    if name == SVD:
        export_hf_checkpoint(peer_svdquant(), export_dir=str(out))
        return
    model = H.tiny_llama()
    scales = H.awq_scales(model) if "AWQ" in name else {}
    mtq.quantize(model, peer_config(mtq, name), H.forward_loop)
    for n, s in scales.items():
        model.get_submodule(n).input_quantizer.pre_quant_scale = s
    export_hf_checkpoint(model, export_dir=str(out))


def describe(folder: Path, name: str) -> dict:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    entry = {
        "tensors": H.layout(tensors),
        "hf_quant_config": json.loads((folder / "hf_quant_config.json").read_text())["quantization"],
        "quantization_config": H.without_producer(
            json.loads((folder / "config.json").read_text())["quantization_config"]
        ),
    }
    if name in H.VALUE_CONFIGS:
        entry["digests"] = {k: H.tensor_digest(v) for k, v in sorted(tensors.items()) if k.endswith(H.WEIGHT_KEYS)}
    return entry


def main() -> None:
    import modelopt

    ref = {"producer": {"name": "modelopt", "version": modelopt.__version__}, "configs": {}}
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        for name in (*H.CONFIGS, SVD):
            out = Path(tmp) / name
            peer_export(name, out)
            ref["configs"][name] = describe(out, name)
    (HERE / "modelopt_reference.json").write_text(json.dumps(ref, indent=1, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
