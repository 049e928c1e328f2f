"""Small real models and data for tests, the demo and benchmarks (all offline: scikit-learn's bundled digits)."""

from .data import DigitsData, load_digits_data
from .denoiser import DenoiserMLP, NoiseSchedule, step_batches, trained_denoiser
from .models import MLP, DigitsCNN, DigitsMLP
from .train import accuracy, evaluate, train_classifier, trained_digits_model

__all__ = [
    "MLP",
    "DenoiserMLP",
    "DigitsCNN",
    "DigitsData",
    "DigitsMLP",
    "NoiseSchedule",
    "accuracy",
    "evaluate",
    "load_digits_data",
    "step_batches",
    "train_classifier",
    "trained_denoiser",
    "trained_digits_model",
]
