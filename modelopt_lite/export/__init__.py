"""Deployment checkpoints (as ModelOpt's ``modelopt.torch.export``).

- :func:`export_hf_checkpoint` (:mod:`.hf_export`): ModelOpt's unified Hugging Face checkpoint (safetensors with
  quantized weights and scales, ``hf_quant_config.json``, ``config.json``'s ``quantization_config``) for FP8,
  INT4 AWQ (W4A16), W4A8 AWQ, NVFP4 and NVFP4 SVDQuant (``NVFP4_SVD``), with FP8/NVFP4 KV-cache scales; the format TensorRT-LLM, vLLM and SGLang
  load.
- :func:`load_hf_checkpoint` (:mod:`.hf_load`): such a checkpoint back into real modules
  (:mod:`modelopt_lite.real`) on a fresh float model, every field validated.
"""

from .hf_export import export_hf_checkpoint, fuse_for_hf_export
from .hf_load import load_hf_checkpoint

__all__ = ["export_hf_checkpoint", "fuse_for_hf_export", "load_hf_checkpoint"]
