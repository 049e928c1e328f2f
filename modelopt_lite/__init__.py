"""modelopt_lite: descriptor-driven quantization for PyTorch, exact against ONNX Runtime's Q/DQ.

Layers, in the direction data flows:
``descriptor`` (ScaledQuantDescriptor) -> ``nn`` (TensorQuantizer, quant modules) -> ``tensor_quant``
(functional ops) -> ``functional`` (torch.library ops, reference numerics, backends) -> ``csrc`` (C++/CUDA kernels).
Around them: ``calib`` (calibrators), ``conversion`` (quantize a model from a config), ``onnx_export``,
``real`` (real INT8 modules and checkpoints), ``analysis``.

Public names are imported lazily, so ``import modelopt_lite`` stays fast and never builds kernels.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it (the contract between the layers)
_LAZY = {
    # functional layer
    "ScaledQuantDescriptor": "modelopt_lite.descriptor",
    "QuantDescriptor": "modelopt_lite.descriptor",
    # ModelOpt's ``modelopt.torch.quantization.config.QuantizerAttributeConfig``: a descriptor that also carries
    # ModelOpt's other quantizer settings (bias, num_steps, calibrator, ...)
    "QuantizerAttributeConfig": "modelopt_lite.nn",
    # the submodule, never its function of the same name (that is ``modelopt_lite.tensor_quant.tensor_quant``):
    # ``import modelopt_lite.tensor_quant`` binds the submodule here too, so anything else would depend on import order
    "tensor_quant": ("modelopt_lite.tensor_quant", None),
    "fake_tensor_quant": "modelopt_lite.tensor_quant",
    "scaled_e4m3": "modelopt_lite.tensor_quant",
    "fake_affine_tensor_quant": "modelopt_lite.tensor_quant",
    "fake_block_quant": "modelopt_lite.tensor_quant",
    "quantize_tensor": ("modelopt_lite.functional.lowlevel", "quantize"),
    "dequantize_tensor": ("modelopt_lite.functional.lowlevel", "dequantize"),
    "set_backend": "modelopt_lite.functional.backend",
    "get_backend": "modelopt_lite.functional.backend",
    "use_backend": "modelopt_lite.functional.backend",
    "precompile": "modelopt_lite.functional.backend",
    # value checks of CUDA tensors: deferred (no host sync per call) or sync (raise at the call)
    "set_error_checks": "modelopt_lite.functional.deferred_errors",
    "get_error_checks": "modelopt_lite.functional.deferred_errors",
    "error_checks": "modelopt_lite.functional.deferred_errors",
    "check_errors": "modelopt_lite.functional.deferred_errors",
    "DeferredValueError": "modelopt_lite.functional.deferred_errors",
    # modules and conversion
    "TensorQuantizer": "modelopt_lite.nn.tensor_quantizer",
    "quant_nn": ("modelopt_lite.nn", None),
    "quant_modules": ("modelopt_lite.quant_modules", None),
    "calib": ("modelopt_lite.calib", None),
    "opt": ("modelopt_lite.opt", None),
    "model_calib": ("modelopt_lite.model_calib", None),
    "utils": ("modelopt_lite.utils", None),
    "plugins": ("modelopt_lite.plugins", None),
    "optim": ("modelopt_lite.optim", None),
    "cuda_ext": ("modelopt_lite.cuda_ext", None),
    "quantize": "modelopt_lite.conversion.model_quant",
    "calibrate": "modelopt_lite.conversion.model_quant",
    "calibrate_loop": "modelopt_lite.conversion.model_quant",
    "print_quant_summary": "modelopt_lite.conversion.quantizer_table",
    "summary": "modelopt_lite.conversion.quantizer_table",
    "register": "modelopt_lite.conversion.registry",
    "unregister": "modelopt_lite.conversion.registry",
    "registered": "modelopt_lite.conversion.registry",
    "QuantModuleRegistry": "modelopt_lite.nn.modules._registry",
    "replace_quant_module": "modelopt_lite.conversion.model_quant",
    "replace_quant_modules": "modelopt_lite.conversion.model_quant",
    "set_quantizer_attribute": "modelopt_lite.conversion.quantizer_attrs",
    "postprocess_amax": "modelopt_lite.conversion.quantizer_attrs",
    "set_quantizer_by_cfg": "modelopt_lite.conversion.model_quant",
    "set_quantizer_by_cfg_context": "modelopt_lite.conversion.cfg_context",
    "enable_quantizer": "modelopt_lite.conversion.quantizer_attrs",
    "disable_quantizer": "modelopt_lite.conversion.quantizer_attrs",
    "enable_onnx_export": "modelopt_lite.quant_modules",
    "save": "modelopt_lite.conversion.save_restore",
    "restore": "modelopt_lite.conversion.save_restore",
    "quant_step": "modelopt_lite.conversion.quant_steps",
    "share_relu_grids": "modelopt_lite.algorithms.relu_grids",
    "set_requant": "modelopt_lite.conversion.requant",
    "need_calibration": "modelopt_lite.conversion.calibration_need",
    "INT8_DEFAULT_CFG": "modelopt_lite.presets",
    "INT8_HISTOGRAM_CFG": "modelopt_lite.presets",
    "FP8_DEFAULT_CFG": "modelopt_lite.presets",
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": "modelopt_lite.presets",
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": "modelopt_lite.presets",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": "modelopt_lite.presets",
    "W4A8_CFG": "modelopt_lite.presets",
    "INT8_ORT_CFG": "modelopt_lite.presets",
    "INT8_ORT_REDUCED_RANGE_CFG": "modelopt_lite.presets",
    "INT8_SMOOTHQUANT_CFG": "modelopt_lite.presets",
    "NVFP4_DEFAULT_CFG": "modelopt_lite.presets",
    "W4A16_NVFP4_CFG": "modelopt_lite.presets",
    "W4A8_NVFP4_FP8_CFG": "modelopt_lite.presets",
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG": "modelopt_lite.presets",
    "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG": "modelopt_lite.presets",
    "MXFP8_DEFAULT_CFG": "modelopt_lite.presets",
    "MXFP4_DEFAULT_CFG": "modelopt_lite.presets",
    "MXINT8_DEFAULT_CFG": "modelopt_lite.presets",
    "smooth_quant": "modelopt_lite.algorithms.smoothquant",
    "INT8_ATTENTION_CFG": "modelopt_lite.presets",
    "INT8_SMOOTHQUANT_ATTENTION_CFG": "modelopt_lite.presets",
    "FP8_ATTENTION_CFG": "modelopt_lite.presets",
    "FP8_KV_CFG": "modelopt_lite.presets",
    "INT8_KV_CFG": "modelopt_lite.presets",
    "NVFP4_KV_CFG": "modelopt_lite.presets",
    "FP8_AFFINE_KV_CFG": "modelopt_lite.presets",
    "NVFP4_AFFINE_KV_CFG": "modelopt_lite.presets",
    "with_kv_cache": "modelopt_lite.presets",
    "register_attention_module": "modelopt_lite.nn.modules.quant_attention_hf",
    "INT4_AWQ_CFG": "modelopt_lite.presets",
    "W4A8_AWQ_BETA_CFG": "modelopt_lite.presets",
    "NVFP4_AWQ_LITE_CFG": "modelopt_lite.presets",
    "NVFP4_SVDQUANT_DEFAULT_CFG": "modelopt_lite.presets",
    "INT4_SVDQUANT_CFG": "modelopt_lite.presets",
    "svdquant": "modelopt_lite.algorithms.svdquant",
    "awq": "modelopt_lite.algorithms.awq",
    "algorithms": ("modelopt_lite.algorithms", None),
    "presets": ("modelopt_lite.presets", None),
    # export
    "export_onnx": "modelopt_lite.onnx_export.export",
    "inspect_onnx": "modelopt_lite.onnx_export.inspect",
    "export": ("modelopt_lite.export", None),
    "export_hf_checkpoint": "modelopt_lite.export.hf_export",
    "load_hf_checkpoint": "modelopt_lite.export.hf_load",
    # real quantization
    "fake2real": "modelopt_lite.real.convert",
    "compress": "modelopt_lite.real.convert",
    "load_real": "modelopt_lite.real.checkpoint",
    "real_quant": "modelopt_lite.real.checkpoint",
    "fake_quant": "modelopt_lite.real.seed_api",
    # analysis
    "analysis": ("modelopt_lite.analysis", None),
    "auto_quantize": "modelopt_lite.algorithms.auto_quantize",
}

#: names from this layer run calibration (quantize, calibrate, ...), so resolving one first registers the weight
#: algorithms (AWQ, GPTQ, ...); model_calib imports them itself, and real/opt/export never calibrate
_NEEDS_ALGORITHMS = ("modelopt_lite.conversion",)

__all__ = [*sorted(_LAZY), "__version__"]  # noqa: PLE0604 (the lazy names are strings)


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'modelopt_lite' has no attribute {name!r}")
    mod_name, attr = target if isinstance(target, tuple) else (target, name)
    if mod_name.startswith(_NEEDS_ALGORITHMS):
        importlib.import_module("modelopt_lite.algorithms")  # registers the weight algorithms calibrate dispatches to
    mod = importlib.import_module(mod_name)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return __all__
