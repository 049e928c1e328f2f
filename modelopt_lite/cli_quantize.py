"""``modelopt-lite quantize``: model factory + state dict + calibration inputs + config -> calibrated ONNX export.

Every problem the user can fix (a bad path, factory, config name, JSON file or input file) raises
:class:`modelopt_lite.cli.CLIError` with a message saying what to change. Every file read is untrusted: state dicts
and calibration tensors are loaded without unpickling (``weights_only=True``, ``allow_pickle=False``) and checked
(names, tensor types, finite values), JSON configs are parsed strictly and validated before use. The only module
imported by name is the one the user typed after ``--model``; nothing a file names is ever imported.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

from .cli_errors import CLIError

_INT_KEY = re.compile(r"^-?\d+$")


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _first_bad_value(t):
    """The first non-finite value of a floating tensor, or None."""
    import torch

    if not t.dtype.is_floating_point:
        return None
    bad = ~torch.isfinite(t)
    return t[bad].flatten()[0].item() if bool(bad.any()) else None


def load_factory_model(spec: str):
    """``"package.module:factory"`` -> ``factory()`` (an ``nn.Module``), with actionable errors."""
    from torch import nn

    if spec.count(":") != 1 or not all(spec.split(":")):
        raise CLIError(f"--model must look like MODULE:FACTORY (e.g. modelopt_lite.examples:DigitsCNN), got {spec!r}")
    mod_name, attr = spec.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise CLIError(
            f"--model: cannot import module {mod_name!r} ({e}); check the name and that it is on "
            "PYTHONPATH (run from the folder that contains it)"
        ) from e
    except Exception as e:  # the user's module failed while importing: one line (--debug shows the traceback)
        raise CLIError(f"--model: importing module {mod_name!r} raised {_one_line(e)}") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CLIError(f"--model: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CLIError(f"--model: {spec} is not callable; give a class or a function that returns an nn.Module")
    try:
        model = obj()
    except TypeError as e:
        raise CLIError(f"--model: calling {spec}() failed ({e}); the factory must take no arguments") from e
    except Exception as e:  # the factory itself failed: one line (--debug shows the traceback)
        raise CLIError(f"--model: calling {spec}() raised {_one_line(e)}") from e
    if not isinstance(model, nn.Module):
        raise CLIError(f"--model: {spec}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def load_state_dict(model, path: str) -> None:
    """Load a ``torch.save``-d state dict (tensors only) into ``model``, strictly."""
    import torch

    p = Path(path)
    if not p.is_file():
        raise CLIError(f"--state-dict: no such file: {p}")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CLIError(f"--state-dict: cannot read {p} with torch.load ({type(e).__name__}: {e})") from e
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise CLIError(f"--state-dict: {p} holds a {type(sd).__name__}, expected a state dict (name -> tensor)")
    for k, v in sd.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise CLIError(
                f"--state-dict: {p}: entry {k!r} holds a {type(v).__name__}; a state dict maps names to tensors"
            )
        bad = _first_bad_value(v)
        if bad is not None:
            raise CLIError(f"--state-dict: {p}: entry {k!r} holds a non-finite value ({bad})")
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0:3]
        raise CLIError(f"--state-dict: {p} does not match the model: {' '.join(s.strip() for s in first)}") from e


def load_calib_batches(path: str, batch_size: int) -> list:
    """Calibration batches from a ``.npy`` array or a ``.pt`` tensor / list of tensors (float64 -> float32)."""
    import numpy as np
    import torch

    if batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {batch_size}")
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"--calib: no such file: {p}")
    try:
        if p.suffix == ".npy":
            data = torch.from_numpy(np.load(p, allow_pickle=False))
        elif p.suffix in (".pt", ".pth"):
            data = torch.load(p, map_location="cpu", weights_only=True)
        else:
            raise CLIError(f"--calib: {p} must be a .npy or .pt file")
    except CLIError:
        raise
    except Exception as e:
        raise CLIError(f"--calib: cannot read {p} ({type(e).__name__}: {e})") from e

    def _fix(t, where: str = ""):
        if not isinstance(t, torch.Tensor):
            raise CLIError(f"--calib: {p} must hold a tensor or a list of tensors, found {type(t).__name__}")
        if t.dtype == torch.bool or t.dtype.is_complex:
            raise CLIError(f"--calib: {p}{where} holds {t.dtype} values; give real numbers")
        bad = _first_bad_value(t)
        if bad is not None:
            raise CLIError(f"--calib: {p}{where} holds a non-finite value ({bad}); calibration data must be finite")
        if t.dtype == torch.float64:
            t = t.float()
        if t.ndim == 0 or t.shape[0] == 0:
            raise CLIError(
                f"--calib: {p} holds an empty or 0-d tensor (shape {tuple(t.shape)}); the first "
                "dimension must be the samples"
            )
        return t

    if isinstance(data, (list, tuple)):
        if not data:
            raise CLIError(f"--calib: {p} holds an empty list")
        return [_fix(t, f" (batch {i})") for i, t in enumerate(data)]
    data = _fix(data)
    return [data[i : i + batch_size] for i in range(0, data.shape[0], batch_size)]


def _int_keys(obj):
    """JSON object keys are strings: turn ``{"-1": 16}`` back into ``{-1: 16}`` inside ``block_sizes``."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            v = _int_keys(v)
            if k in ("block_sizes", "scale_block_sizes") and isinstance(v, dict):
                v = {(int(kk) if isinstance(kk, str) and _INT_KEY.match(kk) else kk): vv for kk, vv in v.items()}
            out[k] = v
        return out
    if isinstance(obj, list):
        return [_int_keys(v) for v in obj]
    return obj


def _no_constants(name: str):
    raise ValueError(f"the JSON literal {name} is not allowed")


def load_config(spec: str):
    """A preset name (``modelopt_lite.conversion.config.PRESETS``) or a JSON file shaped like the presets."""
    import copy

    from .conversion.config import PRESETS, normalize_config

    if spec in PRESETS:
        return copy.deepcopy(PRESETS[spec])
    p = Path(spec)
    if p.suffix.lower() == ".json" or p.exists():
        if not p.is_file():
            raise CLIError(f"--config: no such file: {p}")
        try:
            cfg = json.loads(p.read_text(encoding="utf-8"), parse_constant=_no_constants)
        except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
            raise CLIError(f"--config: {p} is not valid JSON ({e})") from e
        if not isinstance(cfg, dict):
            raise CLIError(f"--config: {p} must hold a JSON object (like the presets), got {type(cfg).__name__}")
        cfg = _int_keys(cfg)
        try:
            normalize_config(cfg)
        except (ValueError, TypeError, KeyError) as e:
            raise CLIError(f"--config: {p}: {_one_line(e)}") from e
        return cfg
    raise CLIError(
        f"--config: unknown preset {spec!r}; use one of {', '.join(PRESETS)} or a .json file "
        '(a JSON object {"quant_cfg": {...}, "algorithm": ...})'
    )


def run_quantize(args) -> str:
    """Run the ``quantize`` sub-command; returns the text to print."""
    import torch

    import modelopt_lite as mtq

    model = load_factory_model(args.model)
    if args.state_dict:
        load_state_dict(model, args.state_dict)
    model.eval()
    batches = load_calib_batches(args.calib, args.batch_size)
    config = load_config(args.config)
    out = Path(args.export)
    if out.suffix.lower() != ".onnx":
        raise CLIError(f"--export must name an .onnx file, got {str(out)!r}")
    if out.parent and not out.parent.exists():
        raise CLIError(f"--export: the folder {out.parent} does not exist")

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(b)

    try:
        if args.method is not None:
            config = dict(config, algorithm=args.method)
        mtq.quantize(model, config, forward_loop)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise CLIError(f"quantizing with {args.config} failed: {type(e).__name__}: {e}") from e
    sample = batches[0][: min(len(batches[0]), args.batch_size)]
    try:
        report = mtq.export_onnx(
            model,
            sample,
            str(out),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        )
    except (ValueError, TypeError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CLIError(f"exporting to {out} failed: {type(e).__name__}: {first}") from e
    lines = []
    if args.summary:
        from .conversion.quantizer_table import format_summary

        lines.append(format_summary(mtq.summary(model)))
    lines += [f"note: {n}" for n in getattr(report, "notes", [])]
    n = sum(int(b.shape[0]) for b in batches)
    lines.append(
        f"quantized {args.model} with {args.config} (calibration: {args.method or 'config default'}, "
        f"{n} samples in {len(batches)} batches)"
    )
    lines.append(f"wrote {out} ({out.stat().st_size} bytes; input 'input', output 'output', dynamic batch)")
    return "\n".join(lines)
