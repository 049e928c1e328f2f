"""Training and evaluation helpers for the examples (deterministic, CPU-friendly, with an optional progress bar)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from .data import DigitsData, load_digits_data
from .models import DigitsCNN, DigitsMLP

log = logging.getLogger(__name__)


def _progress(iterable, enabled: bool, desc: str, total: int | None = None):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False)


def train_classifier(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int = 15,
    lr: float = 3e-3,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = False,
    params: list | None = None,
) -> nn.Module:
    """Adam + cross-entropy for ``epochs``; deterministic for a given seed. Returns the model (trained in place)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(params if params is not None else model.parameters(), lr=lr)
    model.train()
    for _ in _progress(range(epochs), progress, "train", epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch_size):
            idx = perm[i : i + batch_size]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    return model


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Logits of ``model`` on ``x`` in eval mode."""
    model.eval()
    return torch.cat([model(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])


def accuracy(model_or_logits, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> float:
    """Top-1 accuracy in percent: ``accuracy(model, x, y)`` or ``accuracy(logits, y=y)``."""
    # the casts change nothing at run time: a missing x or y still fails as before
    logits = (
        model_or_logits
        if isinstance(model_or_logits, torch.Tensor)
        else evaluate(model_or_logits, cast(torch.Tensor, x))
    )
    return 100.0 * (logits.argmax(-1) == cast(torch.Tensor, y)).float().mean().item()


_FACTORIES: dict[str, Callable[[], nn.Module]] = {"cnn": DigitsCNN, "mlp": DigitsMLP}


def trained_digits_model(
    kind: str = "cnn", *, epochs: int = 15, seed: int = 0, progress: bool = False, data: DigitsData | None = None
) -> nn.Module:
    """A freshly trained digits model (``"cnn"`` or ``"mlp"``), deterministic for a seed (~2 s on 2 CPU cores)."""
    if kind not in _FACTORIES:
        raise ValueError(f"kind must be one of {sorted(_FACTORIES)}, got {kind!r}")
    data = data or load_digits_data()
    with torch.random.fork_rng(devices=[]):  # deterministic init without touching the caller's RNG state
        torch.manual_seed(seed)
        model = _FACTORIES[kind]()
    train_classifier(model, data.x_train, data.y_train, epochs=epochs, seed=seed, progress=progress)
    log.info("trained digits %s: test accuracy %.2f%%", kind, accuracy(model, data.x_test, data.y_test))
    return model
