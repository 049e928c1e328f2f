"""Example float models: the digits CNN (Conv-BN-ReLU x2 + Linear), a digits MLP and a generic wide MLP."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU, Conv-BN-ReLU (stride 2), Linear: ~98% test accuracy on the 8x8 digits after ~2 s of training."""

    def __init__(self, c1: int = 16, c2: int = 32, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c1, c2, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(c2)
        self.relu2 = nn.ReLU()
        self.fc = nn.Linear(c2 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


class MLP(nn.Module):
    """``depth`` Linear+ReLU layers of width ``hidden`` then a Linear head (inputs are flattened)."""

    def __init__(self, in_features: int = 64, hidden: int = 128, out_features: int = 10, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.flatten(x, 1)))


def DigitsMLP() -> MLP:
    """The MLP sized for the 8x8 digits: 64 -> 128 -> 128 -> 10."""
    return MLP(64, 128, 10, depth=2)
