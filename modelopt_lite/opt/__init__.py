"""ModelOpt's ``modelopt.torch.opt`` for quantized models: ``import modelopt_lite.opt as mto``.

- ``mto.modelopt_state(model)``: the quantization state as ModelOpt's plain dict;
- ``mto.restore_from_modelopt_state(model, state)``: re-create it on a float model (then ``load_state_dict``);
- ``mto.save(model, path)`` / ``mto.restore(model, path)``: ModelOpt's checkpoint (state + ``state_dict``), read
  with ``torch.load(weights_only=True)`` only and validated entry by entry.

Files ModelOpt wrote for quantized models restore here, and ours in ModelOpt. (``modelopt_lite.save`` /
``modelopt_lite.restore`` write this project's JSON + safetensors pair instead.)
"""

from .checkpoint import load_checkpoint, restore, restore_from_modelopt_state, save
from .state import MODELOPT_VERSION, modelopt_state

__all__ = [
    "MODELOPT_VERSION",
    "load_checkpoint",
    "modelopt_state",
    "restore",
    "restore_from_modelopt_state",
    "save",
]
