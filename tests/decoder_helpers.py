"""Tiny Hugging Face decoders (GPT-2, Llama with grouped-query attention) for the KV-cache tests."""

from __future__ import annotations

import torch
import transformers

from modelopt_lite.conversion.utils import named_quantizers

VOCAB = 40


def tiny_decoder(arch: str, attn: str = "eager", seed: int = 0, llama_hidden: int = 16):
    """A 2-layer ``arch`` ("gpt2" or "llama") causal LM with random weights, in eval mode."""
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=llama_hidden,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,  # grouped-query attention: the keys are repeated per head
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = attn
    return cls(cfg).eval()


def prompt(batch=2, length=5, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def kv_quantizers(model):
    return {n: q for n, q in named_quantizers(model) if n.endswith(("k_bmm_quantizer", "v_bmm_quantizer"))}


def generate_new(model, prompt, n=4):
    """The ``n`` greedily generated tokens after ``prompt``."""
    out = model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, prompt.shape[1] :]
