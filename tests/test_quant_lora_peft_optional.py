"""peft is optional: without it nothing LoRA-related is registered or imported, and quantization works as before."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from torch import nn

from modelopt_lite.nn.modules.quant_lora_peft import find_peft_lora, is_peft_lora_linear_class


def test_the_finder_matches_peft_lora_linear_only():
    assert find_peft_lora(nn.Linear) is None  # a class named Linear elsewhere is not peft's
    assert not is_peft_lora_linear_class(type("Linear", (nn.Module,), {"__module__": "peft.tuners.lora.bnb"}))
    assert not is_peft_lora_linear_class(object())
    fake = type("Linear", (nn.Module,), {"__module__": "peft.tuners.lora.layer"})
    assert is_peft_lora_linear_class(fake)


def test_quantize_never_imports_peft():
    code = textwrap.dedent(
        """
        import sys
        import torch
        from torch import nn
        import modelopt_lite as mtq
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        x = torch.randn(3, 4)
        mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
        assert type(model[0]).__name__ == "QuantLinear"
        assert not any(n == "peft" or n.startswith("peft.") for n in sys.modules), "peft was imported"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
