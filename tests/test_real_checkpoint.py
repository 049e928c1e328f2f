"""Real checkpoints: safetensors + JSON, bit-exact round trips, compact sizes, clear architecture mismatches."""

import json

import pytest
import torch
from real_helpers import data, fake_model

from modelopt_lite.analysis import calculate_model_size
from modelopt_lite.analysis.metrics import state_dict_bytes
from modelopt_lite.examples import MLP, DigitsCNN, DigitsMLP
from modelopt_lite.real import fake2real, load_real, read_checkpoint, real_quant


@pytest.mark.parametrize("kind,factory", [("cnn", DigitsCNN), ("mlp", DigitsMLP)])
def test_round_trip_is_bit_exact(kind, factory, tmp_path):
    real = fake2real(fake_model(kind), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_int8.json", "model_int8.safetensors"]
    cfg = json.loads((tmp_path / "model_int8.json").read_text())
    assert cfg["format"] == "modelopt_lite.real" and cfg["version"] == 1
    loaded = load_real(factory().eval(), tmp_path)
    a, b = real.state_dict(), loaded.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    x = data().x_test[:100]
    with torch.no_grad():
        assert torch.equal(real(x), loaded(x))
    # the file alone (config in its metadata) is enough
    (tmp_path / "model_int8.json").unlink()
    again = load_real(factory().eval(), tmp_path / "model_int8.safetensors")
    with torch.no_grad():
        assert torch.equal(real(x), again(x))


def test_checkpoint_tensor_dtypes(tmp_path):
    fake2real(fake_model("mlp"), tmp_path)
    cfg, tensors = read_checkpoint(tmp_path)
    assert tensors["body.0.weight"].dtype == torch.int8 and tensors["body.0.weight"].shape == (128, 64)
    assert tensors["body.0.weight_scale"].dtype == torch.float32 and tensors["body.0.weight_scale"].shape == (128,)
    assert tensors["body.0.input_scale"].shape == (1,)
    assert cfg["modules"]["head"]["weight"] == {
        "num_bits": 8,
        "unsigned": False,
        "narrow_range": False,
        "layout": "channel",
        "axis": [0],
        "block_sizes": None,
        "storage": "int8",
        "dtype": "float32",
    }


def test_sizes():
    fmlp = MLP(256, 512, 10, depth=3)
    fp32 = state_dict_bytes(DigitsMLP().state_dict())
    real = fake2real(fake_model("mlp"), inplace=False)
    ratio = state_dict_bytes(real.state_dict()) / fp32
    # 25856 int8 weights + (266 biases + 266 weight scales + 3 input scales) float32 = 27996 bytes
    assert state_dict_bytes(real.state_dict()) == 25856 + 4 * (266 + 266 + 3)
    assert ratio <= 0.27
    assert calculate_model_size(real)["total_bytes"] == 27996
    del fmlp


def test_int4_checkpoint_round_trip_and_size(tmp_path):
    real = fake2real(fake_model("mlp", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"), tmp_path)
    loaded = load_real(DigitsMLP().eval(), tmp_path)
    x = data().x_test[:50]
    with torch.no_grad():
        assert torch.equal(real(x), loaded(x))
    size = calculate_model_size(real)
    # packed: 25856 weights / 2 bytes; block scales (128 + 128 + 10) * 1 block each; biases 266
    assert size["bytes_by_dtype"]["torch.uint8"] == 25856 // 2
    assert size["total_bytes"] == 25856 // 2 + 4 * (266 + 266)


def test_different_architecture_names_first_mismatching_tensor(tmp_path):
    fake2real(fake_model("mlp"), tmp_path)
    with pytest.raises(ValueError, match=r"tensor 'body\.0\.weight': the model has no module 'body\.0'"):
        load_real(DigitsCNN(), tmp_path)
    wider = MLP(64, 256, 10, depth=2)
    with pytest.raises(
        ValueError,
        match=r"tensor 'body\.0\.weight': shape \[128, 64\] in the checkpoint, "
        r"\[256, 64\] in the model",
    ):
        load_real(wider, tmp_path)
    assert type(wider.body[0]) is torch.nn.Linear  # untouched
    deeper = MLP(64, 128, 10, depth=3)
    with pytest.raises(ValueError, match=r"tensor 'body\.4\.weight' is missing from the checkpoint"):
        load_real(deeper, tmp_path)
    shallow = MLP(64, 128, 10, depth=1)
    with pytest.raises(ValueError, match=r"tensor 'body.2.weight': the model has no module 'body.2'"):
        load_real(shallow, tmp_path)


def test_real_quant_seed_loader_checks_bits_and_steps(tmp_path):
    fake2real(fake_model("mlp"), tmp_path)
    m = real_quant(DigitsMLP().eval(), 8, 1, tmp_path)
    assert type(m.head).__name__ == "QuantizedLinear"
    with pytest.raises(ValueError, match=r"module 'body.0' .* has n_bits=8, num_steps=1; expected n_bits=4"):
        real_quant(DigitsMLP(), 4, 1, tmp_path)
    with pytest.raises(FileNotFoundError, match="no real checkpoint"):
        load_real(DigitsMLP(), tmp_path / "nope")


def test_save_refuses_fake_modules(tmp_path):
    fq = fake_model("mlp")
    from modelopt_lite.real import save_real

    with pytest.raises(ValueError, match="still has fake-quant modules"):
        save_real(fq, tmp_path)
