"""Hugging Face DBRX experts convert to one quantized Linear per expert (ModelOpt's w1/v1/w2_linear layout)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
import modelopt_lite.opt as mto
from modelopt_lite.nn import QuantLinear, QuantModuleRegistry
from modelopt_lite.nn.modules.quant_dbrx_hf import find_hf_dbrx, quant_dbrx_class

pytest.importorskip("transformers")
from transformers.models.dbrx.configuration_dbrx import DbrxConfig, DbrxFFNConfig  # noqa: E402
from transformers.models.dbrx.modeling_dbrx import DbrxExpertGLU, DbrxExperts, DbrxFFN  # noqa: E402

E, F, H = 4, 8, 32


def _ffn(seed: int = 1, dtype=torch.float32) -> DbrxFFN:
    # d_model, not hidden_size: transformers 5.x copies d_model into ffn_config.hidden_size in __post_init__
    config = DbrxConfig(ffn_config=DbrxFFNConfig(ffn_hidden_size=F, moe_num_experts=E, moe_top_k=2), d_model=H)
    torch.manual_seed(seed)
    m = DbrxFFN(config)
    with torch.no_grad():
        for name in ("w1", "v1", "w2"):
            getattr(m.experts.mlp, name).copy_(torch.randn(E * F, H))
    return m.to(dtype)


def _x(tokens: int = 12) -> torch.Tensor:
    return torch.randn(2, tokens // 2, H, generator=torch.Generator().manual_seed(tokens))


def test_registered_and_converted_to_per_expert_linears():
    assert DbrxExperts in QuantModuleRegistry and DbrxExpertGLU in QuantModuleRegistry
    assert QuantModuleRegistry.get_key(DbrxExperts) == "DbrxExperts"
    assert find_hf_dbrx(nn.Linear) is None
    ref = _ffn()
    model = mtq.replace_quant_module(_ffn())
    glu = model.experts.mlp
    assert type(model.experts) is quant_dbrx_class(DbrxExperts) and isinstance(model.experts, DbrxExperts)
    assert type(glu) is quant_dbrx_class(DbrxExpertGLU)
    for name in ("w1", "v1", "w2"):
        assert not hasattr(glu, name) and len(getattr(glu, f"{name}_linear")) == E
    split = {n: getattr(ref.experts.mlp, n).view(E, F, H) for n in ("w1", "v1", "w2")}
    for e in range(E):
        for name, shape in (("w1", (F, H)), ("v1", (F, H)), ("w2", (H, F))):
            lin = getattr(glu, f"{name}_linear")[e]
            assert type(lin) is QuantLinear and lin.bias is None and lin.weight.shape == shape
            want = split[name][e].t() if name == "w2" else split[name][e]
            assert torch.equal(lin.weight, want) and lin.weight.dtype == torch.float32
    assert torch.equal(torch.cat(list(glu.w1_linear.parameters())), ref.experts.mlp.w1)
    assert ref.experts.mlp.w1.shape == (E * F, H) and type(ref.experts) is DbrxExperts  # the float model is untouched


@pytest.mark.parametrize("tokens", [2, 4, 10, 12, 34])
def test_outputs_equal_the_float_module_with_quantizers_disabled(tokens):
    ref = _ffn()
    model = mtq.replace_quant_module(_ffn())
    mtq.set_quantizer_attribute(model, "*", {"enable": False})
    x = _x(tokens)
    with torch.no_grad():
        out, want = model(x), ref(x)
    assert out.shape == want.shape == (2, tokens // 2, H) and out.dtype == torch.float32
    assert torch.equal(out, want)


def test_quantize_calibrates_each_expert_on_its_own():
    x = _x(64)
    model = mtq.quantize(_ffn(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    ref = _ffn()
    for e in range(E):
        for name in ("w1", "v1", "w2"):
            lin = getattr(model.experts.mlp, f"{name}_linear")[e]
            w = ref.experts.mlp.get_parameter(name).detach().view(E, F, H)[e]
            w = w.t() if name == "w2" else w
            assert torch.equal(lin.weight_quantizer.amax, w.abs().amax(1, keepdim=True))
            assert lin.input_quantizer.amax is not None and lin.input_quantizer.amax.numel() == 1
    with torch.no_grad():
        q, f = model(x), ref(x)
    assert not torch.equal(q, f) and torch.nn.functional.cosine_similarity(q.flatten(), f.flatten(), 0) > 0.99


def test_save_restore_and_mto_restore_into_a_float_model(tmp_path):
    x = _x(64)
    model = mtq.quantize(_ffn(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with torch.no_grad():
        want = model(x)
    mtq.save(model, tmp_path / "q")
    restored = mtq.restore(_ffn(), tmp_path / "q")
    state, weights = mto.modelopt_state(model), model.state_dict()
    from_state = mto.restore_from_modelopt_state(_ffn(), state)
    from_state.load_state_dict(weights)
    mto.save(model, tmp_path / "mto.pth")
    from_file = mto.restore(_ffn(), tmp_path / "mto.pth")
    with torch.no_grad():
        for m in (restored, from_state, from_file):
            assert type(m.experts.mlp.w2_linear[3]) is QuantLinear
            assert torch.equal(m(x), want)


def test_restore_rejects_a_state_of_other_expert_shapes(tmp_path):
    x = _x(64)
    mtq.save(mtq.quantize(_ffn(), mtq.INT8_DEFAULT_CFG, lambda m: m(x)), tmp_path / "q")
    config = DbrxConfig(ffn_config=DbrxFFNConfig(ffn_hidden_size=F + 1, moe_num_experts=E), d_model=H)
    model = DbrxFFN(config)
    with pytest.raises(
        ValueError, match=r"w1_linear\.0'.*has parameters \{'weight': \[9, 32\]\}, the saved state has .*\[8, 32\]"
    ):
        mtq.restore(model, tmp_path / "q")
    assert type(model.experts) is DbrxExperts and model.experts.mlp.w1.shape == ((F + 1) * E, H)  # left unchanged


def test_from_float_rejects_other_modules_and_bad_fused_weights():
    cls = quant_dbrx_class(DbrxExpertGLU)
    with pytest.raises(TypeError, match="expects a transformers DbrxExpertGLU, got Linear"):
        cls.from_float(nn.Linear(3, 5))
    glu = _ffn().experts.mlp
    glu.w2 = nn.Parameter(torch.zeros(E * F, H + 1))
    with pytest.raises(ValueError, match=r"'w2' must be shaped .* \(32, 32\), got \(32, 33\)"):
        cls.from_float(glu)


def test_bfloat16_experts_keep_their_dtype_and_quantize():
    x = _x(16).to(torch.bfloat16)
    model = _ffn(dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experts no token reached
        model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    assert model.experts.mlp.v1_linear[0].weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(x).dtype == torch.bfloat16


def test_a_quantized_model_pickles(tmp_path):
    x = _x(64)
    model = mtq.quantize(_ffn(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert type(loaded.experts) is quant_dbrx_class(DbrxExperts)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
