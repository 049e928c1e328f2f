"""MaxCalibrator and the shared calibrator contract (errors, non-finite input, axes, repr)."""

import pytest
import torch

from modelopt_lite.calib import HistogramCalibrator, MaxCalibrator


def test_simple_run_and_dtype():
    torch.manual_seed(1)
    x = torch.randn(31, 17)
    cal = MaxCalibrator(8)
    assert cal.compute_amax() is None
    cal.collect(x)
    amax = cal.compute_amax()
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert torch.equal(amax, x.abs().max())


def test_running_max_over_batches_and_no_mutation():
    torch.manual_seed(2)
    xs = [torch.randn(8, 5) * s for s in (1.0, 3.0, 0.5)]
    copies = [x.clone() for x in xs]
    cal = MaxCalibrator(8)
    for x in xs:
        cal.collect(x)
    for x, c in zip(xs, copies):
        assert torch.equal(x, c)
    assert torch.equal(cal.compute_amax(), torch.stack([x.abs().max() for x in xs]).max())
    assert torch.equal(cal.compute_amax("max"), cal.compute_amax())  # idempotent


@pytest.mark.parametrize(
    "axis,keep", [(0, (0,)), (-4, (0,)), (1, (1,)), ((0, 2), (0, 2)), ((2, 0), (0, 2)), (-1, (3,))]
)
def test_per_axis_keepdims(axis, keep):
    torch.manual_seed(3)
    x = torch.randn(3, 4, 5, 6)
    cal = MaxCalibrator(8, axis=axis)
    cal.collect(x)
    cal.collect(x * 0.5)
    reduce = tuple(d for d in range(4) if d not in keep)
    ref = x.abs().amax(dim=reduce, keepdim=True)
    amax = cal.compute_amax()
    assert amax.shape == ref.shape
    assert torch.equal(amax, ref)


def test_axis_checked_on_first_collect():
    cal = MaxCalibrator(8, axis=3)
    with pytest.raises(ValueError, match="out of range for a tensor of rank 2"):
        cal.collect(torch.randn(3, 4))
    with pytest.raises(TypeError, match="axis must be None"):
        MaxCalibrator(8, axis=1.5)
    with pytest.raises(TypeError, match="axis must be None"):
        MaxCalibrator(8, axis=True)


def test_shape_change_raises_naming_both_shapes():
    cal = MaxCalibrator(8, axis=0, name="fc.weight_quantizer")
    cal.collect(torch.randn(4, 3))
    cal.collect(torch.randn(4, 7))  # reduced dims may change
    with pytest.raises(ValueError, match=r"'fc.weight_quantizer'.*\(4, 1\) before, \(5, 1\) now"):
        cal.collect(torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"\(4, 1\) before, \(rank 3 instead of 2\) now"):
        cal.collect(torch.randn(4, 3, 2))


def test_per_tensor_accepts_any_shape():
    cal = MaxCalibrator(8)
    cal.collect(torch.ones(2, 3))
    cal.collect(torch.full((5,), -2.0))
    assert torch.equal(cal.compute_amax(), torch.tensor(2.0))


def test_track_amax_and_reset():
    cal = MaxCalibrator(8, axis=1, track_amax=True)
    a = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    b = torch.tensor([[4.0, 0.0], [0.0, 1.0]])
    cal.collect(a)
    cal.collect(b)
    assert len(cal.amaxs) == 2
    assert torch.equal(cal.amaxs[0], torch.tensor([[1.0, 3.0]]))
    assert torch.equal(cal.amaxs[1], torch.tensor([[4.0, 1.0]]))
    assert torch.equal(cal.compute_amax(), torch.tensor([[4.0, 3.0]]))
    cal.reset()
    assert cal.compute_amax() is None and cal.amaxs == []
    cal.collect(torch.ones(3, 5))  # a new shape is fine after reset
    assert cal.compute_amax().shape == (1, 5)
    assert MaxCalibrator(8).amaxs == []


def test_compute_amax_signature():
    cal = MaxCalibrator(8, name="q")
    cal.collect(torch.ones(3))
    with pytest.raises(TypeError, match="unexpected keyword argument.*percentile"):
        cal.compute_amax(percentile=99.9)
    with pytest.raises(TypeError, match="start_bin.*no keyword arguments"):
        cal.compute_amax("max", start_bin=3)
    with pytest.raises(ValueError, match="unknown method 'entropy'"):
        cal.compute_amax("entropy")


def test_nonfinite_raises_with_name_and_counts():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0])
    for cal in (MaxCalibrator(8, name="layer1.input_quantizer"), HistogramCalibrator(8, name="layer1.input_quantizer")):
        with pytest.raises(ValueError, match=r"'layer1.input_quantizer'.*1 NaN and 2 Inf"):
            cal.collect(x)


def test_nonfinite_skipped_and_counted():
    x = torch.tensor([[1.0, float("nan"), -3.0], [float("inf"), 2.0, 0.5]])
    cal = MaxCalibrator(8, skip_nonfinite=True)
    cal.collect(x)
    cal.collect(x)
    assert cal.num_nonfinite == 4
    assert torch.equal(cal.compute_amax(), torch.tensor(3.0))
    cal = MaxCalibrator(8, axis=0, skip_nonfinite=True)
    cal.collect(x)
    assert torch.equal(cal.compute_amax(), torch.tensor([[3.0], [2.0]]))
    cal = MaxCalibrator(8, skip_nonfinite=True)
    cal.collect(torch.full((4,), float("nan")))
    assert cal.num_nonfinite == 4 and torch.equal(cal.compute_amax(), torch.tensor(0.0))


def test_unsigned_rejects_negative():
    cal = MaxCalibrator(8, unsigned=True, name="relu_out")
    cal.collect(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"'relu_out'.*negative values \(minimum -0.5\)"):
        cal.collect(torch.tensor([1.0, -0.5]))


def test_bad_inputs_and_args():
    cal = MaxCalibrator(8)
    with pytest.raises(TypeError, match="torch.Tensor"):
        cal.collect([1.0, 2.0])
    with pytest.raises(TypeError, match="real-valued"):
        cal.collect(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_bits"):
        MaxCalibrator(17)
    with pytest.raises(ValueError, match=r"\(4, 3\)"):
        MaxCalibrator((3, 2))  # (5, 2) is E5M2 now (MX blocks)
    with pytest.raises(TypeError, match="track_amax"):
        MaxCalibrator(8, None, False, 1)
    cal.collect(torch.empty(0))  # nothing collected
    assert cal.compute_amax() is None


def test_low_precision_and_integer_inputs():
    x = torch.tensor([0.1, -7.5, 3.0], dtype=torch.bfloat16)
    cal = MaxCalibrator(8)
    cal.collect(x)
    assert torch.equal(cal.compute_amax(), torch.tensor(7.5))
    cal = MaxCalibrator((4, 3))
    cal.collect(torch.arange(-5, 3))
    assert torch.equal(cal.compute_amax(), torch.tensor(5.0))


def test_requires_grad_input_is_detached():
    x = torch.randn(4, 4, requires_grad=True)
    cal = MaxCalibrator(8)
    cal.collect(x * 2)
    assert not cal.compute_amax().requires_grad


def test_repr():
    cal = MaxCalibrator(8, axis=0, name="w")
    assert repr(cal) == "MaxCalibrator(name='w', num_bits=8, axis=0, unsigned=False, track_amax=False, amax=None)"
    cal.collect(torch.tensor([[1.0], [-2.0]]))
    assert "amax=[1, 2] (min, max)" in repr(cal)
    cal = MaxCalibrator(4, unsigned=True)
    cal.collect(torch.tensor([0.25]))
    assert repr(cal).endswith("unsigned=True, track_amax=False, amax=0.25)")
