"""The ``modelopt-lite`` command line: every sub-command, its output and its error exits (1: ours, 2: argparse)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import modelopt_lite
from modelopt_lite.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- top level ------------------------------------------------------------------------------------------------------
def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "quantize", "inspect", "precompile"):
        assert cmd in out
    assert "--fast" not in out


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "required: COMMAND" in capsys.readouterr().err


def test_python_dash_m_runs_the_same_cli():
    r = subprocess.run(
        [sys.executable, "-m", "modelopt_lite", "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"modelopt-lite {modelopt_lite.__version__}"


# --- demo -----------------------------------------------------------------------------------------------------------
def test_demo_rejects_unknown_model_and_bad_threads(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--model", "resnet"])
    assert e.value.code == 2
    assert "invalid choice: 'resnet'" in capsys.readouterr().err
    code, _, err = _run(capsys, "demo", "--threads", "0")
    assert code == 1
    assert err.strip() == "modelopt-lite demo: error: --threads must be >= 1, got 0"


def test_demo_out_must_be_a_folder_and_missing_extras_are_named(capsys, monkeypatch, tmp_path):
    (tmp_path / "f").write_text("x")
    code, _, err = _run(capsys, "demo", "--out", str(tmp_path / "f"))
    assert code == 1
    assert (
        err.strip() == f"modelopt-lite demo: error: --out {tmp_path / 'f'} is a file; give a folder for the "
        "ONNX files and plots"
    )
    from modelopt_lite import demo

    def missing(model, **kwargs):
        raise ImportError("the MiniLM demo needs transformers: pip install transformers")

    monkeypatch.setattr(demo, "run_demo", missing)
    code, _, err = _run(capsys, "demo", "--model", "minilm", "--out", str(tmp_path / "o"))
    assert code == 1
    assert err.strip() == "modelopt-lite demo: error: the MiniLM demo needs transformers: pip install transformers"


@pytest.mark.slow
def test_demo_fast_prints_one_table_and_the_output_folder(capsys, monkeypatch, tmp_path_factory):
    from _fast_demo import fast_digits_result

    from modelopt_lite.demo import digits

    seen = {}

    def spy(out, **kwargs):  # the real fast run (shared with test_demo.py), recording what the CLI asked for
        seen.update(kwargs, out=out)
        return fast_digits_result(tmp_path_factory.getbasetemp() / "fast_demo")

    monkeypatch.setattr(digits, "run", spy)
    code, out, err = _run(capsys, "demo", "--fast", "--no-progress", "--out", "somewhere", "--cache-dir", "cache")
    assert code == 0, err
    assert seen == {
        "out": "somewhere",
        "fast": True,
        "plots": False,
        "progress": False,
        "threads": None,
        "cache_dir": "cache",
    }
    result = fast_digits_result(tmp_path_factory.getbasetemp() / "fast_demo")
    lines = out.strip().splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    assert table[0].split("|")[1].strip() == "format"
    assert len(table) == 2 + 8  # header, separator, FP32 + 7 quantized variants
    assert [ln.split("|")[2].strip() for ln in table[2:7]] == ["-", "max", "percentile", "mse", "entropy"]
    assert lines[-1].startswith(f"output folder: {result.out_dir}")
    assert "MISSED" not in out
    assert len(list(result.out_dir.glob("*.onnx"))) == 8


def test_demo_defaults_reach_the_demo(capsys, monkeypatch):
    from modelopt_lite import demo

    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda model, **kw: seen.update(kw, model=model) or "TABLE")
    code, out, _ = _run(capsys, "demo", "--model", "minilm", "--threads", "2", "--no-plots")
    assert code == 0 and out == "TABLE\n"
    assert seen == {
        "model": "minilm",
        "out": "modelopt_lite_out",
        "fast": False,
        "plots": False,
        "progress": True,
        "threads": 2,
        "cache_dir": None,
    }


# --- quantize -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    from modelopt_lite.examples import DigitsCNN

    torch.save(DigitsCNN().state_dict(), d / "cnn.pt")
    x = torch.rand(96, 1, 8, 8)
    np.save(d / "calib.npy", x.numpy().astype(np.float64))
    torch.save([x[:48], x[48:]], d / "calib.pt")
    np.save(d / "wrong_shape.npy", np.zeros((10, 3), np.float32))
    (d / "bad.json").write_text("{not json", encoding="utf-8")
    (d / "cfg.json").write_text(
        json.dumps(
            {
                "quant_cfg": {
                    "default": {"enable": False},
                    "*weight_quantizer": {"num_bits": 8, "axis": 0, "enable": True},
                    "*input_quantizer": {"num_bits": 8, "calib_method": "histogram", "enable": True},
                },
                "algorithm": "max",
            }
        ),
        encoding="utf-8",
    )
    (d / "typo.json").write_text(json.dumps({"quant_cfg": {"*weight_quantizer": {"num_bitz": 8}}}), encoding="utf-8")
    return d


def _quantize(
    capsys,
    files,
    *extra,
    model="modelopt_lite.examples:DigitsCNN",
    calib="calib.npy",
    config="INT8_DEFAULT_CFG",
    export="q.onnx",
):
    argv = [
        "quantize",
        "--model",
        model,
        "--calib",
        str(files / calib),
        "--config",
        config,
        "--export",
        str(files / export),
        *extra,
    ]
    return _run(capsys, *argv)


def test_quantize_preset_then_inspect(capsys, files):
    code, out, err = _quantize(capsys, files, "--state-dict", str(files / "cnn.pt"))
    assert code == 0, err
    path = files / "q.onnx"
    assert path.is_file() and path.stat().st_size > 0
    assert out.strip().splitlines()[-1] == (
        f"wrote {path} ({path.stat().st_size} bytes; input 'input', output 'output', dynamic batch)"
    )
    assert "96 samples in 2 batches" in out
    import onnx

    graph = onnx.load(str(path)).graph
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= {n.op_type for n in graph.node}
    assert graph.input[0].name == "input" and graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    code, out, err = _run(capsys, "inspect", str(path))
    assert code == 0, err
    assert "QuantizeLinear" in out or "quantize" in out.lower()


def test_quantize_json_config_with_method_and_pt_batches(capsys, files):
    code, out, err = _quantize(
        capsys,
        files,
        "--method",
        "percentile",
        "--summary",
        calib="calib.pt",
        config=str(files / "cfg.json"),
        export="j.onnx",
    )
    assert code == 0, err
    # the two BatchNorms are quantized modules too (as in ModelOpt): this config's "*input_quantizer" enables theirs
    assert "conv1.weight_quantizer" in out and "13 quantizers: 8 enabled, 8 calibrated" in out
    assert "(calibration: percentile, 96 samples in 2 batches)" in out
    assert (files / "j.onnx").is_file()


@pytest.mark.parametrize(
    ("kwargs", "extra", "message"),
    [
        ({"model": "DigitsCNN"}, (), "--model must look like MODULE:FACTORY"),
        ({"model": "no_such_module_xyz:f"}, (), "--model: cannot import module 'no_such_module_xyz'"),
        (
            {"model": "modelopt_lite.examples:Nope"},
            (),
            "--model: module 'modelopt_lite.examples' has no attribute 'Nope'",
        ),
        ({"model": "modelopt_lite:__version__"}, (), "--model: modelopt_lite:__version__ is not callable"),
        ({"model": "modelopt_lite.examples:load_digits_data"}, (), "returned DigitsData, not a torch.nn.Module"),
        ({}, ("--state-dict", "missing.pt"), "--state-dict: no such file: missing.pt"),
        ({"calib": "nope.npy"}, (), "--calib: no such file:"),
        ({"calib": "bad.json"}, (), "must be a .npy or .pt file"),
        ({"config": "INT9_CFG"}, (), "--config: unknown preset 'INT9_CFG'; use one of INT8_DEFAULT_CFG"),
        ({"config": "{d}/bad.json"}, (), "is not valid JSON"),
        ({"config": "{d}/missing.json"}, (), "--config: no such file:"),
        ({"config": "{d}/typo.json"}, (), "num_bitz"),
        ({"export": "q.txt"}, (), "--export must name an .onnx file"),
        ({"calib": "wrong_shape.npy"}, (), "quantizing with INT8_DEFAULT_CFG failed: RuntimeError"),
        ({}, ("--batch-size", "0"), "--batch-size must be >= 1, got 0"),
    ],
)
def test_quantize_errors_say_what_to_fix(capsys, files, kwargs, extra, message):
    kwargs = {k: v.format(d=files) for k, v in kwargs.items()}
    code, out, err = _quantize(capsys, files, *extra, **kwargs)
    assert code == 1, (out, err)
    assert err.startswith("modelopt-lite quantize: error: ")
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_quantize_state_dict_mismatch(capsys, files, tmp_path):
    torch.save({"weight": torch.zeros(3)}, tmp_path / "other.pt")
    code, _, err = _quantize(capsys, files, "--state-dict", str(tmp_path / "other.pt"))
    assert code == 1
    assert "does not match the model" in err


def test_quantize_missing_required_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--model", "modelopt_lite.examples:DigitsCNN"])
    assert e.value.code == 2
    assert "the following arguments are required: --calib, --config, --export" in capsys.readouterr().err


# --- inspect / precompile -------------------------------------------------------------------------------------------
def test_inspect_errors(capsys, tmp_path):
    code, _, err = _run(capsys, "inspect", str(tmp_path / "none.onnx"))
    assert code == 1
    assert (
        err.strip() == f"modelopt-lite inspect: error: inspect: no such file: {tmp_path / 'none.onnx'} "
        "(give the path of an .onnx file)"
    )
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not an onnx model")
    code, _, err = _run(capsys, "inspect", str(junk))
    assert code == 1
    assert f"could not read {junk} as an ONNX model" in err


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ({"cpu": "ok", "cuda": "skipped: CUDA is not available"}, 0),
        ({"cpu": "failed: CalledProcessError: no compiler", "cuda": "skipped: CUDA is not available"}, 1),
    ],
)
def test_precompile_prints_each_kind(capsys, monkeypatch, status, code):
    monkeypatch.setattr(modelopt_lite, "precompile", lambda: dict(status))
    got, out, _ = _run(capsys, "precompile")
    assert got == code
    assert out.splitlines() == [f"{k.ljust(4)}  {v}" for k, v in status.items()]


# --- untrusted inputs and failing factories -------------------------------------------------------------------------
@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    (tmp_path / "h2_cli_factories.py").write_text(
        "def boom():\n    raise RuntimeError('no weights for this model\\nsecond line of the message')\n",
        encoding="utf-8",
    )
    (tmp_path / "h2_cli_broken.py").write_text("raise ValueError('broken at import')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "model, message",
    [
        (
            "h2_cli_factories:boom",
            "--model: calling h2_cli_factories:boom() raised RuntimeError: no weights for this model",
        ),
        ("h2_cli_broken:anything", "--model: importing module 'h2_cli_broken' raised ValueError: broken at import"),
    ],
)
def test_failing_factory_is_one_line_and_debug_shows_the_traceback(capsys, files, user_modules, model, message):
    code, out, err = _quantize(capsys, files, model=model)
    assert code == 1, (out, err)
    assert err.strip() == f"modelopt-lite quantize: error: {message}"
    assert "Traceback" not in err
    argv = [
        "--debug",
        "quantize",
        "--model",
        model,
        "--calib",
        str(files / "calib.npy"),
        "--config",
        "INT8_DEFAULT_CFG",
    ]
    code, _, err = _run(capsys, *argv, "--export", str(files / "d.onnx"))
    assert code == 1
    assert err.startswith(f"modelopt-lite quantize: error: {message}\n") and "Traceback (most recent call last)" in err


def test_untrusted_input_files_are_validated(capsys, files, tmp_path):
    x = torch.rand(8, 1, 8, 8)
    x[3, 0, 2, 2] = float("nan")
    np.save(tmp_path / "nan.npy", x.numpy())
    torch.save([torch.rand(4, 1, 8, 8), x], tmp_path / "nan.pt")
    torch.save([torch.ones(4, 1, 8, 8, dtype=torch.bool)], tmp_path / "bool.pt")
    sd = torch.load(files / "cnn.pt")
    sd_nan = dict(sd, **{"conv1.weight": sd["conv1.weight"].clone().fill_(float("inf"))})
    torch.save(sd_nan, tmp_path / "inf.pt")
    torch.save(dict(sd, **{"conv1.weight": 3}), tmp_path / "notensor.pt")
    (tmp_path / "nan.json").write_text('{"quant_cfg": {"*input_quantizer": {"amax": NaN}}}', encoding="utf-8")
    (tmp_path / "cls.json").write_text('{"quant_cfg": {"nn.h2_cli_cls_module": {"*": {"enable": false}}}}')
    cases = [
        ({"calib": str(tmp_path / "nan.npy")}, (), f"--calib: {tmp_path / 'nan.npy'} holds a non-finite value (nan)"),
        ({"calib": str(tmp_path / "nan.pt")}, (), f"--calib: {tmp_path / 'nan.pt'} (batch 1) holds a non-finite value"),
        ({"calib": str(tmp_path / "bool.pt")}, (), "(batch 0) holds torch.bool values; give real numbers"),
        ({}, ("--state-dict", str(tmp_path / "inf.pt")), "entry 'conv1.weight' holds a non-finite value (inf)"),
        ({}, ("--state-dict", str(tmp_path / "notensor.pt")), "entry 'conv1.weight' holds a int; a state dict maps"),
        ({"config": str(tmp_path / "nan.json")}, (), "is not valid JSON (the JSON literal NaN is not allowed"),
        ({"config": str(tmp_path / "cls.json")}, (), f"--config: {tmp_path / 'cls.json'}: QuantConfigError: "),
    ]
    for kwargs, extra, message in cases:
        code, out, err = _quantize(capsys, files, *extra, **kwargs)
        assert code == 1, (kwargs, out, err)
        assert message in err, err
        assert len(err.strip().splitlines()) == 1
    assert "h2_cli_cls_module" not in sys.modules


def test_cli_modules_do_not_import_each_other_in_a_cycle():
    import ast

    tree = ast.parse((ROOT / "modelopt_lite" / "cli_quantize.py").read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "cli" not in imported and "cli_errors" in imported
    from modelopt_lite.cli import CLIError
    from modelopt_lite.cli_quantize import CLIError as C2

    assert CLIError is C2
