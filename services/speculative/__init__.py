"""Speculative-decoding math: pure functions, tensors in, tensors out."""

from services.speculative.block_length import BlockLengthController
from services.speculative.params import SamplingParams
from services.speculative.sampling import sample_from_probs, warp_logits
from services.speculative.stats import SpecDecodingStats
from services.speculative.verification import Verification, greedy_verify, rejection_sample

__all__ = [
    "BlockLengthController",
    "SamplingParams",
    "SpecDecodingStats",
    "Verification",
    "greedy_verify",
    "rejection_sample",
    "sample_from_probs",
    "warp_logits",
]
