"""Speculative-decoding math: pure functions, tensors in, tensors out.

Names load on first use (lazy_loader): the wire types beside the math (SamplingParams, SpecDecodingStats) are read
by processes that never touch a tensor (the gateway, the CLI), and must not pull torch in with them."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "block_length": ["BlockLengthController"],
    "params": ["SamplingParams"],
    "sampling": ["sample_from_probs", "warp_logits"],
    "stats": ["SpecDecodingStats"],
    "verification": ["Verification", "greedy_verify", "rejection_sample"],
})
