"""QuantEmbedding with per-row INT8 / INT4 and FP8 weights: the looked-up rows are the reference fake quant of the
table's rows, and the exported graph (quantized initializer -> DequantizeLinear -> Gather) runs in ONNX Runtime
bit for bit as torch computes it."""

import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.functional import reference
from modelopt_lite.nn.modules.quant_embedding import QuantEmbedding
from modelopt_lite.onnx_export.ort_runner import ort_session

# descriptor, stored initializer type, opset the automatic choice picks
CASES = {
    "int8_row": (QD(num_bits=8, axis=(0,)), TensorProto.INT8, 17),
    "int4_row": (QD(num_bits=4, axis=(0,)), TensorProto.INT4, 21),
    "fp8_row": (QD(num_bits=(4, 3), axis=(0,)), TensorProto.FLOAT8E4M3FN, 19),
    "fp8_tensor": (QD(num_bits=(4, 3)), TensorProto.FLOAT8E4M3FN, 19),
    "int4_block": (QD(num_bits=4, block_sizes={-1: 4}), TensorProto.INT4, 21),
}


def _ref_table(w: torch.Tensor, desc) -> torch.Tensor:
    """The reference fake quant of the table, written out per granularity from the numerics contract."""
    if desc.block_sizes:
        rows, dim = w.shape
        blocks = w.reshape(rows, dim // 4, 4)
        scale = blocks.abs().amax(-1, keepdim=True) / 7.0
        return reference.fake_quant_int(blocks, scale, -8, 7).reshape(rows, dim)
    amax = w.abs().amax(1, keepdim=True) if desc.axis else w.abs().amax()
    if desc.num_bits == (4, 3):
        return reference.fake_e4m3(w, amax.float() / 448.0)
    bound = 2 ** (desc.num_bits - 1) - 1
    return reference.fake_quant_int(w, amax / bound, -bound - 1, bound)


class _Tok(nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.emb = emb
        self.proj = nn.Linear(emb.embedding_dim, 3)

    def forward(self, idx):
        return self.proj(self.emb(idx))


def _model(desc, seed=0, padding_idx=None):
    torch.manual_seed(seed)
    emb = QuantEmbedding(12, 8, padding_idx=padding_idx, quant_desc_weight=desc)
    with torch.no_grad():
        emb.weight[5].mul_(30.0)  # one large row: per-row scales must differ from a per-tensor one
    m = _Tok(emb).eval()
    with mtq.calibrate(m, "max"):
        m(torch.arange(12))
    return m


@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_equal_reference_fake_quant(case):
    desc, _, _ = CASES[case]
    m = _model(desc)
    w = m.emb.weight.detach()
    ref = _ref_table(w, desc)
    idx = torch.tensor([[0, 5, 11, 5], [3, 3, 7, 1]])
    with torch.no_grad():
        out = m.emb(idx)
    assert out.dtype == torch.float32 and out.shape == (2, 4, 8)
    assert torch.equal(out, F.embedding(idx, ref))
    assert not torch.equal(ref, w)  # something was quantized
    if desc.axis:  # per row: the big row 5 does not coarsen the others
        assert torch.equal(m.emb.weight_quantizer.amax.flatten(), w.abs().amax(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_gather_of_dequantized_codes_runs_bit_exact_in_ort(case, tmp_path):
    desc, code_type, opset = CASES[case]
    m = _model(desc, padding_idx=0)
    m.proj = nn.Identity()  # only the embedding: its output is compared bit for bit
    path = tmp_path / f"{case}.onnx"
    rep = mtq.export_onnx(m, torch.tensor([[1, 2]]), path, dynamic_axes={"input": {0: "b", 1: "t"}})
    assert rep.opset == opset
    proto = onnx.load(path)
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    assert [n.op_type for n in g.node] == ["DequantizeLinear", "Gather"]
    dq, gather = g.node
    assert inits[dq.input[0]].data_type == code_type  # the table is stored quantized, no float copy left
    assert not any(t.data_type == TensorProto.FLOAT and list(t.dims) == [12, 8] for t in g.initializer)
    assert gather.input[0] == dq.output[0] and gather.input[1] == "input"
    idx = torch.tensor([[0, 5, 11, 5, 2], [3, 3, 7, 1, 0], [9, 10, 4, 6, 8]])
    with torch.no_grad():
        expected = m(idx)
    for optimize in (True, False):
        got = ort_session(path, optimize=optimize).run(None, {"input": idx.numpy()})[0]
        assert torch.equal(torch.from_numpy(got), expected), (case, optimize)


def test_embedding_enabled_by_a_config_entry_and_exported_with_the_linear(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 4))
    cfg = {
        "quant_cfg": {
            "default": {"enable": False},
            "*weight_quantizer": {"num_bits": 8, "axis": 0, "enable": True},
            "*input_quantizer": {"num_bits": 8, "axis": None, "enable": True},
            "nn.Embedding": {"*weight_quantizer": {"num_bits": 4, "axis": 0, "enable": True}},
        },
        "algorithm": "max",
    }
    idx = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, cfg, lambda m: m(idx))
    assert isinstance(model[0], QuantEmbedding) and model[0].weight_quantizer.num_bits == 4
    with torch.no_grad():
        emb = model[0](idx)
    assert torch.equal(emb, F.embedding(idx, _ref_table(model[0].weight.detach(), QD(num_bits=4, axis=(0,)))))
    path = tmp_path / "m.onnx"
    mtq.export_onnx(model, idx, path)
    g = onnx.load(path).graph
    prod = {o: n for n in g.node for o in n.output}
    gather = next(n for n in g.node if n.op_type == "Gather")
    assert prod[gather.input[0]].op_type == "DequantizeLinear"
    with torch.no_grad():
        expected = model(idx)
    got = ort_session(path).run(None, {"input": idx.numpy()})[0]
    # the Linear's float GEMM may round differently in ORT; the embedding rows themselves are exact (tested above)
    assert got.shape == tuple(expected.shape)
    assert torch.allclose(torch.from_numpy(got), expected, atol=1e-5)


def test_uncalibrated_embedding_export_names_the_quantizer(tmp_path):
    m = _Tok(QuantEmbedding(6, 4)).eval()
    with pytest.raises(ValueError, match="emb.weight_quantizer"):
        mtq.export_onnx(m, torch.tensor([[1, 2]]), tmp_path / "x.onnx")
