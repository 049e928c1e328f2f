"""modelopt_lite: exact, fast, descriptor-driven quantization for PyTorch (pure-Python install; kernels JIT-build)."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="modelopt_lite",
    version="0.1.0",
    description="Descriptor-driven quantization for PyTorch: exact Q/DQ numerics, calibration, QAT, ONNX export",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["modelopt_lite", "modelopt_lite.*"]),
    package_data={"modelopt_lite": ["csrc/*.cpp", "csrc/*.cu", "csrc/*.h", "csrc/*.cuh"]},
    include_package_data=True,
    install_requires=["torch", "numpy", "onnx"],
    extras_require={
        "cpu": ["onnxruntime"],
        "gpu": ["onnxruntime-gpu"],
        "dev": ["pytest", "hypothesis", "ninja", "ruff", "onnxruntime", "onnxscript", "safetensors", "tqdm",
                "scikit-learn"],
        "demo": ["onnxruntime", "scikit-learn", "tqdm", "safetensors", "matplotlib", "transformers",
                 "onnxscript"],
    },
    entry_points={"console_scripts": ["modelopt-lite=modelopt_lite.cli:main"]},
)
