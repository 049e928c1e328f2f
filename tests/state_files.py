"""Crafting saved files for the tests of the loaders' checks (``restore``, ``load_real``): tensors rewritten with
their record (SHA-256) updated, so that the per-entry checks must catch the change on their own (a file made by
hand, not a corrupted one)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modelopt_lite.conversion.state_file import TENSOR_METADATA, sha256_of
from modelopt_lite.real.checkpoint import DIGEST_KEY, tensors_digest


def edit_saved_tensors(st_path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply ``fn`` to the tensors of ``<name>.safetensors`` and vouch for the result in ``<name>.json``."""
    st_path = Path(st_path)
    tensors = load_file(str(st_path))
    fn(tensors)
    save_file(tensors, str(st_path), metadata=TENSOR_METADATA)
    json_path = st_path.with_suffix(".json")
    doc = json.loads(json_path.read_text())
    doc["tensors_sha256"] = sha256_of(st_path)
    json_path.write_text(json.dumps(doc))


def save_crafted_real(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a real checkpoint's tensors with ``metadata`` and the SHA-256 of these tensors (load_real's record of
    them), as a crafted file would: the value checks must catch a bad entry on their own."""
    save_file(tensors, str(path), metadata={**metadata, DIGEST_KEY: tensors_digest(tensors)})
