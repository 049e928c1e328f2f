"""pytorch-quantization drop-in names (issue 26): ``utils.reduce_amax``, ``optim.helper``,
``quant_modules.QuantModuleReplacementHelper``."""

import pytest
import torch
from torch import nn

from modelopt_lite import quant_modules, quant_nn
from modelopt_lite import utils as quant_utils
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.optim import helper


# --- utils.reduce_amax -------------------------------------------------------------------------------------------
def test_reduce_amax_values_shapes_and_errors():
    x = torch.tensor([[1.0, -5.0, 2.0], [-0.5, 0.25, 3.0]])
    full = quant_utils.reduce_amax(x)
    assert full.shape == () and full.item() == 5.0
    rows = quant_utils.reduce_amax(x, axis=1)
    assert rows.shape == (2, 1) and rows.dtype == torch.float32
    assert torch.equal(rows, torch.tensor([[5.0], [3.0]]))
    cols = quant_utils.reduce_amax(x, axis=(0,), keepdims=False)
    assert torch.equal(cols, torch.tensor([1.0, 5.0, 3.0]))
    assert torch.equal(quant_utils.reduce_amax(x, axis=-1), rows)
    assert torch.equal(x, torch.tensor([[1.0, -5.0, 2.0], [-0.5, 0.25, 3.0]]))  # input untouched
    with pytest.raises(ValueError, match="Cannot reduce more axes"):
        quant_utils.reduce_amax(x, axis=(0, 1, 2))
    with pytest.raises(ValueError, match="out of range"):
        quant_utils.reduce_amax(x, axis=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quant_utils.reduce_amax([1.0, 2.0])


# --- optim.helper ------------------------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = quant_nn.QuantConv2d(1, 2, 3)
        self.block = nn.Sequential(nn.Linear(4, 4), quant_nn.QuantLinear(4, 3))
        self.head = nn.Linear(3, 2, bias=False)


def test_match_parameters_searches_names():
    net = _Net()
    assert [p.shape for p in helper.match_parameters(net, ["conv1"])] == [(2, 1, 3, 3), (2,)]
    assert len(list(helper.match_parameters(net, ["weight$"]))) == 4
    assert len(list(helper.match_parameters(net, ["^block", "bias"]))) == 5  # each parameter once
    assert not list(helper.match_parameters(net, ["wei$"]))
    with pytest.raises(TypeError, match="list of regular expression"):
        list(helper.match_parameters(net, "conv1"))


def test_group_parameters_and_optimizer():
    net = _Net()
    groups = helper.group_parameters(net, [["conv1"], ["block.1"]], lrs=[0.1, 0.01], weight_decays=[0.0, 1e-4])
    assert [len(g["params"]) for g in groups] == [2, 2]
    assert groups[0]["lr"] == 0.1 and groups[1]["weight_decay"] == 1e-4 and "momentum" not in groups[0]
    torch.optim.SGD(groups, lr=1.0).step()
    with pytest.raises(TypeError, match="must be list of list of patterns"):
        helper.group_parameters(None, [["conv1"], "head"])
    with pytest.raises(TypeError, match=r"len\(momentums\) must match"):
        helper.group_parameters(None, [["conv1"], ["head"]], momentums=[0.9])


def test_freeze_parameters():
    net = _Net()
    helper.freeze_parameters(net, ["^head"])
    assert [n for n, p in net.named_parameters() if not p.requires_grad] == ["head.weight"]


def test_quant_weight_inplace_puts_weights_on_the_grid():
    torch.manual_seed(0)
    net = _Net()
    net.conv1.weight_quantizer.disable()
    conv_before = net.conv1.weight.detach().clone()
    float_before = net.block[0].weight.detach().clone()
    want = net.block[1].weight_quantizer(net.block[1].weight).detach()
    helper.quant_weight_inplace(net)
    assert torch.equal(net.block[1].weight.detach(), want)
    assert not torch.equal(want, float_before)
    assert torch.equal(net.conv1.weight.detach(), conv_before)  # disabled quantizer: untouched
    assert torch.equal(net.block[0].weight.detach(), float_before)  # no weight quantizer: untouched
    again = net.block[1].weight_quantizer(net.block[1].weight).detach()
    assert torch.equal(again, want)
    assert isinstance(net.block[1].weight, nn.Parameter) and net.block[1].weight.requires_grad


# --- quant_modules.QuantModuleReplacementHelper ------------------------------------------------------------------
@pytest.fixture
def _restore_nn():
    orig = {name: getattr(nn, name) for _, name, _ in quant_modules.DEFAULT_QUANT_MAP}
    yield orig
    quant_modules.deactivate()
    for name, cls in orig.items():
        setattr(nn, name, cls)


def test_replacement_helper_prepare_apply_restore(_restore_nn):
    orig = _restore_nn
    helper_ = quant_modules.QuantModuleReplacementHelper()
    with pytest.raises(RuntimeError, match="prepare_state"):
        helper_.apply_quant_modules()
    helper_.prepare_state(["Linear"], None)
    assert "Linear" not in helper_.quant_map and helper_.quant_map["Conv2d"] is quant_nn.QuantConv2d
    assert nn.Conv2d is orig["Conv2d"]  # preparing patches nothing
    helper_.apply_quant_modules()
    assert nn.Conv2d is quant_nn.QuantConv2d and nn.Linear is orig["Linear"]
    assert quant_modules.active()["Conv2d"] is quant_nn.QuantConv2d
    helper_.restore_float_modules()
    assert all(getattr(nn, n) is c for n, c in orig.items()) and quant_modules.active() == {}

    custom = quant_modules.QuantModuleReplacementHelper()
    custom.prepare_state(["Linear"], [(torch.nn, "Linear", quant_nn.QuantLinear)])  # the custom map wins
    custom.apply_quant_modules()
    assert type(nn.Linear(2, 2)) is quant_nn.QuantLinear
    custom.restore_float_modules()
    assert nn.Linear is orig["Linear"]
    with pytest.raises(TypeError, match="custom_quant_modules"):
        custom.prepare_state(None, [(torch.nn, "NoSuchLayer", quant_nn.QuantLinear)])


# --- errors: the peers' exception types kept inside ours ---------------------------------------------------------
def test_negative_input_to_unsigned_is_both_value_and_type_error():
    from modelopt_lite import tensor_quant as tq
    from modelopt_lite.functional.checks import NegativeUnsignedInputError

    x = torch.tensor([0.5, -1.0, 2.0])
    for call in (
        lambda: tq.tensor_quant(x, 2.0, 8, True),  # pytorch-quantization's layout
        lambda: tq.fake_tensor_quant(x, 2.0, None, 8, True),  # ModelOpt's layout
        lambda: tq.fake_tensor_quant(x, 2.0, num_bits=8, unsigned=True),
    ):
        with pytest.raises(TypeError, match=r"Negative values encountered.*\(minimum -1\.0\)"):
            call()
        with pytest.raises(ValueError, match="with negative values"):
            call()
    q = quant_nn.TensorQuantizer(tq.QuantDescriptor(unsigned=True), name="relu_in")
    with pytest.raises(NegativeUnsignedInputError, match="'relu_in'.*Negative values encountered"):
        q(x)


def test_unknown_float_format_is_both_value_and_type_error():
    from modelopt_lite import tensor_quant as tq

    for exc in (TypeError, ValueError):
        with pytest.raises(exc, match=r"num_bits=\(7, 3\) is not a supported floating-point format"):
            tq.QuantDescriptor(num_bits=(7, 3))


def test_descriptor_amax_of_wrong_type_is_a_type_error():
    from modelopt_lite import tensor_quant as tq

    with pytest.raises(TypeError, match="amax must be float, list or ndarray, got 'oops'"):
        tq.QuantDescriptor(amax="oops")
    with pytest.raises(ValueError, match="finite"):
        tq.QuantDescriptor(amax=[1.0, float("nan")])


@pytest.mark.parametrize(
    "build",
    [
        lambda: quant_nn.QuantLinear(4, 3, descriptor="oops"),
        lambda: quant_nn.QuantConv2d(2, 3, 3, descriptor="oops"),
        lambda: quant_nn.QuantConvTranspose1d(2, 3, 3, descriptor="oops"),
    ],
)
def test_unknown_module_keywords_are_named(build):
    with pytest.raises(TypeError, match=r"Unused keys: \['descriptor'\]"):
        build()


def test_module_float_keywords_still_work():
    conv = quant_nn.QuantConv2d(2, 3, kernel_size=3, stride=2, padding_mode="reflect", padding=1, bias=False)
    assert conv.stride == (2, 2) and conv.bias is None and conv.padding_mode == "reflect"
    assert quant_nn.QuantConvTranspose2d(2, 3, 3, output_padding=1, stride=2).output_padding == (1, 1)


def test_tensor_quantizer_peer_private_names():
    from modelopt_lite import tensor_quant as tq

    q = quant_nn.TensorQuantizer(tq.QuantDescriptor(num_bits=6, axis=(0,), unsigned=True))
    assert q._axis == (0,) and q._num_bits == 6 and q._unsigned is True
    x = torch.rand(3, 5)
    assert torch.equal(q._get_amax(x), x.amax(dim=1, keepdim=True))


# --- TensorQuantizer(if_clip=...): the learned clip stage --------------------------------------------------------
def test_clip_only_quantizer_clips_and_learns_its_bounds():
    from modelopt_lite import tensor_quant as tq

    q = quant_nn.TensorQuantizer(tq.QuantDescriptor(amax=0.5, learn_amax=True), if_quant=False, if_clip=True)
    assert isinstance(q.clip, quant_nn.Clip) and q.is_clip_enabled
    assert q.clip.clip_value_min.item() == -0.5 and q.clip.clip_value_max.item() == 0.5
    x = torch.tensor([-2.0, -0.25, 0.1, 0.75], requires_grad=True)
    y = q(x)
    assert torch.equal(y.detach(), torch.tensor([-0.5, -0.25, 0.1, 0.5]))
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert q.clip.clip_value_min.grad.item() == 1.0 and q.clip.clip_value_max.grad.item() == 1.0
    assert {"clip.clip_value_min", "clip.clip_value_max", "_amax"} <= set(q.state_dict())


def test_clip_then_quantize_and_switches():
    from modelopt_lite import tensor_quant as tq

    q = quant_nn.TensorQuantizer(tq.QuantDescriptor(amax=1.0, learn_amax=True))
    assert not q.is_clip_enabled  # built, not run, unless asked
    x = torch.tensor([-3.0, 0.3, 0.9])
    fq = lambda v: tq.fake_tensor_quant(v, 1.0, 8, False, False)  # noqa: E731 (the descriptor's full-range grid)
    assert torch.equal(q(x), fq(x))
    with torch.no_grad():
        q.clip.clip_value_max.fill_(0.5)
    q.enable_clip()
    assert torch.equal(q(x), fq(torch.tensor([-1.0, 0.3, 0.5])))
    q.disable_clip()
    assert torch.equal(q(x), fq(x))


def test_init_learn_amax_sets_the_clip_bounds_and_clip_needs_learn_amax():
    from modelopt_lite import tensor_quant as tq

    q = quant_nn.TensorQuantizer(tq.QuantDescriptor(learn_amax=True))
    assert q.clip.clip_value_max.item() == 1.0  # no fixed amax: [-1, 1] until init_learn_amax
    q.enable_calib()
    q(torch.tensor([[0.5, -2.5], [1.0, 0.25]]))
    q.load_calib_amax()
    q.init_learn_amax()
    assert q.clip.clip_value_min.item() == -2.5 and q.clip.clip_value_max.item() == 2.5
    plain = quant_nn.TensorQuantizer()
    assert not hasattr(plain, "clip")
    with pytest.raises(ValueError, match="needs learn_amax"):
        plain.enable_clip()
    with pytest.raises(ValueError, match="if_clip=True needs learn_amax"):
        quant_nn.TensorQuantizer(if_clip=True)
    with pytest.raises(TypeError, match="if_clip must be a bool"):
        quant_nn.TensorQuantizer(tq.QuantDescriptor(learn_amax=True), if_clip=1)


# --- HistogramCalibrator: the peer's public histogram attributes -------------------------------------------------
def test_histogram_calibrator_peer_attributes():
    from modelopt_lite import calib

    for torch_hist, kind in ((True, torch.Tensor), (False, __import__("numpy").ndarray)):
        cal = calib.HistogramCalibrator(8, None, False, num_bins=8, torch_hist=torch_hist)
        assert cal._calib_hist is None and cal._calib_bin_edges is None
        cal.collect(torch.tensor([0.0, 0.3, 1.0, -3.0]))
        hist, edges = cal._calib_hist, cal._calib_bin_edges
        assert isinstance(hist, kind) and isinstance(edges, kind)
        assert hist.shape == (8,) and edges.shape == (9,) and int(hist.sum()) == 4
        w = float(edges[1])
        assert w == 0.5 and float(edges[-1]) == 4.0  # power-of-two bins from 0 covering max |x| = 3
        assert [int(v) for v in hist] == [2, 0, 1, 0, 0, 0, 1, 0]
    per_channel = calib.HistogramCalibrator(8, 0, False, num_bins=4)
    per_channel.collect(torch.tensor([[1.0, 0.5], [8.0, 0.0]]))
    assert per_channel._calib_hist.shape == (2, 4) and per_channel._calib_bin_edges.shape == (2, 5)


# --- RNN cells: pytorch-quantization's quantizer names switch every matmul ---------------------------------------
def test_rnn_peer_quantizer_groups_switch_all_matmuls():
    torch.manual_seed(0)
    cell = quant_nn.QuantLSTMCell(5, 4, bias=False, fused_gemm=False)
    ref = nn.LSTMCell(5, 4, bias=False)
    ref.load_state_dict(cell.state_dict())
    cell._input_quantizer.disable()
    cell._weight_quantizer.disable()
    assert not any(q.is_enabled for q in cell.cell_quantizers.modules() if isinstance(q, quant_nn.TensorQuantizer))
    x, h, c = torch.randn(3, 5), torch.randn(3, 4), torch.randn(3, 4)
    for got, want in zip(cell(x, (h, c)), ref(x, (h, c))):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    lstm = quant_nn.QuantLSTM(5, 4, num_layers=2, bidirectional=True, fused_gemm=False)
    groups = lstm._input_quantizers
    assert len(groups) == 4 and len(lstm._weight_quantizers) == 4
    assert groups[1].quantizers[0] is lstm.gate_quantizers["l0_reverse"].ih.input_quantizer
    groups[3].disable()
    cells = lstm.gate_quantizers["l1_reverse"]
    assert not cells.ih.input_quantizer.is_enabled and not cells.hh.input_quantizer.is_enabled
    assert cells.ih.weight_quantizer.is_enabled and lstm.gate_quantizers["l1"].hh.input_quantizer.is_enabled
    assert groups[0].num_bits == 8  # other attributes read the first (ih) quantizer


# --- cuda_ext: the peer's kernel entry points, on every device ---------------------------------------------------
def test_cuda_ext_functions_match_tensor_quant():
    from modelopt_lite import cuda_ext
    from modelopt_lite import tensor_quant as tq

    x = torch.randn(2, 3, 4)
    amax = torch.tensor([1.0, 1e-26, 0.5])
    assert torch.equal(
        cuda_ext.fake_tensor_quant(x, x.abs().max(), 4, False), tq.fake_tensor_quant(x, x.abs().max(), 4)
    )
    got = cuda_ext.fake_tensor_quant_with_axis(x, amax, 1)
    assert torch.equal(got, tq.fake_tensor_quant(x, amax.view(1, 3, 1)))
    assert got[:, 1].abs().sum() == 0  # dead amax: zeros
    y = x.clone()
    assert cuda_ext.fake_tensor_quant_(y, 2.0) is y and torch.equal(y, tq.fake_tensor_quant(x, 2.0))
    with pytest.raises(ValueError, match="amax has 3 values for dimension 2"):
        cuda_ext.fake_tensor_quant_with_axis(x, amax, 2)


def test_clip_bounds_are_optional_in_state_dicts():
    from modelopt_lite import tensor_quant as tq

    ptq = quant_nn.TensorQuantizer(tq.QuantDescriptor(amax=[0.5, 2.0], axis=(0,)))
    qat = quant_nn.TensorQuantizer(tq.QuantDescriptor(learn_amax=True))
    qat.load_state_dict(ptq.state_dict())  # a calibrated PTQ model loaded for QAT: bounds from the amax
    assert qat.clip.clip_value_min.item() == -2.0 and qat.clip.clip_value_max.item() == 2.0
    assert torch.equal(qat.amax, torch.tensor([0.5, 2.0]).reshape(ptq.amax.shape))
    plain = quant_nn.TensorQuantizer()
    plain.load_state_dict(qat.state_dict())  # saved bounds are ignored by a quantizer without clip
    assert not hasattr(plain, "clip") and torch.equal(plain.amax, qat.amax.detach())
    again = quant_nn.TensorQuantizer(tq.QuantDescriptor(learn_amax=True))
    with torch.no_grad():
        qat.clip.clip_value_max.fill_(1.25)
    again.load_state_dict(qat.state_dict())
    assert again.clip.clip_value_max.item() == 1.25


def test_learned_clip_bounds_survive_save_and_restore(tmp_path):
    """A QAT model's clip bounds are saved with it (no data lost) and a restore rebuilds the clip stage."""
    import copy

    import modelopt_lite as mtq

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8}}}
    q = mtq.quantize(model, cfg, lambda m: m(torch.randn(16, 8)))
    fresh = copy.deepcopy(q)
    iq = q[0].input_quantizer
    iq.init_learn_amax()
    with torch.no_grad():
        iq.clip.clip_value_max.fill_(1.25)
        iq.clip.clip_value_min.fill_(-0.75)
    iq.enable_clip()
    mtq.save(q, str(tmp_path / "qat"), include_weights=True)
    back = mtq.restore(fresh, str(tmp_path / "qat"))
    rq = back[0].input_quantizer
    assert rq.learn_amax and rq.clip.clip_value_max.item() == 1.25 and rq.clip.clip_value_min.item() == -0.75
    x = torch.randn(5, 8) * 3
    rq.enable_clip()
    assert torch.equal(back(x), q(x))
    rq.set_from_attribute_config({"learn_amax": False})
    assert "clip" not in dict(rq.named_children()) and not rq.is_clip_enabled


# --- TensorQuantizer(fake_quant=False) without an amax: `scale` is the last input's, as the peer's -----------------
def test_real_quant_dynamic_quantizer_reports_the_scale_it_used():
    from modelopt_lite import tensor_quant as tq

    q = quant_nn.TensorQuantizer(QD(num_bits=8, fake_quant=False))
    assert q.scale is None  # nothing quantized yet
    x = torch.tensor([[0.5, -2.0, 1.0]])
    codes = q(x)
    want_q, want_s = tq.tensor_quant(x, x.abs().amax())
    assert torch.equal(codes, want_q) and q.scale.dtype == torch.float32
    assert q.scale.item() == torch.tensor(2.0 / 127, dtype=torch.float32).item() and torch.equal(q.scale, want_s)
    q(x * 4)
    assert q.scale.item() == torch.tensor(8.0 / 127, dtype=torch.float32).item()  # the last input's
    per_row = quant_nn.TensorQuantizer(QD(num_bits=4, axis=0, fake_quant=False))
    per_row(torch.tensor([[7.0, 1.0], [-0.7, 0.1]]))
    assert per_row.scale.shape == (2, 1) and per_row.scale.flatten().tolist() == [1.0, (torch.tensor(0.7) / 7).item()]
    fake = quant_nn.TensorQuantizer(QD(num_bits=8))
    fake(x)
    assert fake.scale is None  # a fake-quant dynamic quantizer keeps no scale (as the peer)
