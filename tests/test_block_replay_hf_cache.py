"""Block replay (AWQ, GPTQ) on a Hugging Face Llama that builds a key/value cache during calibration: every replayed
call starts from the cache as recorded (a replay used to extend the live cache, so eager attention failed on a
32-key / 16-mask mismatch and sdpa attended to stale keys), the result is the one without a cache, bit for bit, and
the caller's caches are left alone."""

from __future__ import annotations

import copy

import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite.algorithms.block_replay import copied, fresh

transformers = pytest.importorskip("transformers")

SEQ = 8


def _llama(attn: str, use_cache: bool = True):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        use_cache=use_cache,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


BATCHES = [torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _loop(model, kept=None):
    with torch.no_grad():
        for b in BATCHES:
            out = model(b)
            if kept is not None:
                kept.append(out.past_key_values)


def _awq(method, **params):
    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    cfg["algorithm"] = {"method": method, **params}
    return cfg


def _gptq():
    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    cfg["algorithm"] = {"method": "gptq"}
    return cfg


CONFIGS = {
    "int4_awq": lambda: copy.deepcopy(mtq.INT4_AWQ_CFG),
    "w4a8_awq": lambda: copy.deepcopy(mtq.W4A8_AWQ_BETA_CFG),
    "awq_clip": lambda: _awq("awq_clip"),
    "awq_full": lambda: _awq("awq_full"),
    "gptq": _gptq,
    "int4_awq_fp8_kv": lambda: mtq.with_kv_cache(mtq.INT4_AWQ_CFG, mtq.FP8_KV_CFG),
    "gptq_int8_kv": lambda: mtq.with_kv_cache(_gptq(), mtq.INT8_KV_CFG),
}


def _quantized(attn, use_cache, name, kept=None):
    model = _llama(attn, use_cache)
    mtq.quantize(model, CONFIGS[name](), lambda m: _loop(m, kept))
    return model


def _logits(model):
    with torch.no_grad():
        return torch.cat([model(b, use_cache=False).logits for b in BATCHES])


FAST = {("eager", "int4_awq"), ("eager", "gptq")}
CASES = [("eager", n) for n in CONFIGS] + [("sdpa", "int4_awq"), ("sdpa", "gptq")]


@pytest.mark.parametrize(
    ("attn", "name"), [c if c in FAST else pytest.param(*c, marks=pytest.mark.slow) for c in CASES]
)
def test_cache_during_calibration_changes_nothing(attn, name):
    kept: list = []
    with_cache = _quantized(attn, True, name, kept)
    without = _quantized(attn, False, name)
    a, b = with_cache.state_dict(), without.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert torch.equal(_logits(with_cache), _logits(without))
    # the caches the loop got back hold that call's keys only: no replay extended them
    assert len(kept) >= len(BATCHES)
    assert all(c.get_seq_length() == SEQ for c in kept)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int4_awq", "gptq"])
def test_eager_matches_sdpa(name):
    eager, sdpa = _quantized("eager", True, name), _quantized("sdpa", True, name)
    float_logits = _logits(_llama("sdpa"))
    le, ls = _logits(eager), _logits(sdpa)
    assert le.shape == ls.shape == (2 * len(BATCHES), SEQ, 128)
    # eager and sdpa round differently, so the searches may differ in the last bits, not in what they find
    assert torch.allclose(le, ls, atol=1e-3, rtol=1e-3)
    err = (le - float_logits).abs().max()
    assert err == pytest.approx((ls - float_logits).abs().max().item(), rel=0.05, abs=1e-4)


class _Counter:
    """A stateful argument, as a key/value cache is: each call changes it."""

    def __init__(self):
        self.calls = 0


def test_recorded_state_is_snapshot_and_each_replay_starts_from_it():
    c = _Counter()
    t = torch.ones(2)
    rec = copied({"cache": c, "x": t, "flag": True, "pair": (t, c)})
    assert rec["cache"] is not c and rec["pair"][1] is not c and rec["x"] is not t
    c.calls = 5  # the live object moves on; the record does not
    assert rec["cache"].calls == 0
    one, two = fresh(rec), fresh(rec)
    one["cache"].calls += 1
    assert two["cache"].calls == 0 and rec["cache"].calls == 0
    assert one["x"] is rec["x"] and one["flag"] is True
