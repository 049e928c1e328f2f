"""A small diffusion-style denoiser whose activation ranges change strongly with the time step.

The forward process is variance exploding: ``x_t = x_0 + sigma_t * eps`` with ``sigma_t`` growing geometrically
(0.02 -> 40 by default), so the denoiser's inputs, and the activations after its first layers, span ~3 orders of
magnitude across steps. One shared amax sized for the noisiest step wastes almost every level at the clean steps;
temporal quantizers (``num_steps`` > 1, one amax per step, selected with :func:`modelopt_lite.quant_step`) do not.

``x_0`` is a 2-D mixture of eight Gaussians on the unit circle (a classic toy diffusion target). The model is an
MLP taking ``(x_t, t)`` that predicts the noise ``eps``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class NoiseSchedule:
    """``sigmas[t]`` for ``t`` in ``0..num_steps-1`` (increasing)."""

    sigmas: torch.Tensor

    @classmethod
    def geometric(cls, num_steps: int = 10, sigma_min: float = 0.02, sigma_max: float = 40.0) -> NoiseSchedule:
        """``num_steps`` sigmas spaced geometrically from ``sigma_min`` to ``sigma_max``."""
        if num_steps < 1 or not 0 < sigma_min <= sigma_max:
            raise ValueError(
                f"need num_steps >= 1 and 0 < sigma_min <= sigma_max, got {num_steps}, {sigma_min}, {sigma_max}"
            )
        r = torch.linspace(math.log(sigma_min), math.log(sigma_max), num_steps, dtype=torch.float64)
        return cls(r.exp().float())

    @property
    def num_steps(self) -> int:
        """Number of time steps."""
        return len(self.sigmas)

    def add_noise(self, x0: torch.Tensor, t, generator: torch.Generator | None = None):
        """``(x_t, eps)`` with ``x_t = x0 + sigma_t * eps``; ``t`` is an int or a (batch,) long tensor."""
        t = _as_steps(t, len(x0), self.num_steps)
        eps = torch.randn(x0.shape, generator=generator)
        return x0 + self.sigmas[t].unsqueeze(-1) * eps, eps


def _as_steps(t, batch: int, num_steps: int) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.long)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"t must be an int or a ({batch},) tensor of steps, got shape {tuple(t.shape)}")
    if bool(((t < 0) | (t >= num_steps)).any()):
        raise ValueError(f"steps must be in [0, {num_steps}), got {t.min().item()}..{t.max().item()}")
    return t


def sample_data(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` points of the eight-Gaussians mixture (centers on the unit circle, std 0.05), shape (n, 2)."""
    k = torch.randint(0, 8, (n,), generator=generator)
    angle = k.float() * (2 * math.pi / 8)
    centers = torch.stack([angle.cos(), angle.sin()], dim=-1)
    return centers + 0.05 * torch.randn(n, 2, generator=generator)


class DenoiserMLP(nn.Module):
    """``eps_hat = f(x_t, t)``: Linear(x_t) + step embedding, ``depth`` Linear+ReLU blocks, Linear head."""

    def __init__(self, dim: int = 2, hidden: int = 64, num_steps: int = 10, depth: int = 2):
        super().__init__()
        self.num_steps = num_steps
        self.inp = nn.Linear(dim, hidden)
        self.t_embed = nn.Embedding(num_steps, hidden)
        blocks: list[nn.Module] = []
        for _ in range(depth):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.body = nn.Sequential(*blocks)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x_t: torch.Tensor, t) -> torch.Tensor:
        t = _as_steps(t, len(x_t), self.num_steps).to(x_t.device)
        h = torch.relu(self.inp(x_t) + self.t_embed(t))
        return self.out(self.body(h))


def step_batches(schedule: NoiseSchedule, n: int = 256, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """One ``(x_t, t)`` batch of ``n`` samples per step (for calibration or evaluation), deterministic per seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(schedule.num_steps):
        x_t, _ = schedule.add_noise(sample_data(n, g), t, g)
        out.append((x_t, t))
    return out


def train_denoiser(
    model: DenoiserMLP,
    schedule: NoiseSchedule,
    *,
    iters: int = 300,
    batch_size: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
) -> DenoiserMLP:
    """Train to predict the noise (MSE) with random steps per sample; deterministic per seed. Returns the model."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(iters):
        x0 = sample_data(batch_size, g)
        t = torch.randint(0, schedule.num_steps, (batch_size,), generator=g)
        x_t, eps = schedule.add_noise(x0, t, g)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x_t, t), eps).backward()
        opt.step()
    model.eval()
    return model


def trained_denoiser(num_steps: int = 10, *, iters: int = 300, seed: int = 0) -> tuple[DenoiserMLP, NoiseSchedule]:
    """A freshly trained ``(DenoiserMLP, NoiseSchedule)`` pair (~1 s on 2 CPU cores), deterministic per seed."""
    schedule = NoiseSchedule.geometric(num_steps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DenoiserMLP(num_steps=num_steps)
    return train_denoiser(model, schedule, iters=iters, seed=seed), schedule
