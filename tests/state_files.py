"""Crafting saved quantization states for the tests of ``restore``'s checks: a tensor file rewritten with changed
tensors, its JSON file's record of it (SHA-256) updated, so that the per-entry checks must catch the change on
their own (a file made by hand, not a corrupted one)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modelopt_lite.conversion.state_file import FORMAT, VERSION, sha256_of


def edit_saved_tensors(st_path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply ``fn`` to the tensors of ``<name>.safetensors`` and vouch for the result in ``<name>.json``."""
    st_path = Path(st_path)
    tensors = load_file(str(st_path))
    fn(tensors)
    save_file(tensors, str(st_path), metadata={"format": FORMAT, "version": str(VERSION)})
    json_path = st_path.with_suffix(".json")
    doc = json.loads(json_path.read_text())
    doc["tensors_sha256"] = sha256_of(st_path)
    json_path.write_text(json.dumps(doc))
