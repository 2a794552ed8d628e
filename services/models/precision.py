"""Run a model at fp32, bf16, fp16 or int8 (Linear layers at int8 with per-token activation scales, CPU:
int8_linear.py).

Norm layers always compute in fp32: low-precision RMSNorm statistics are
where reduced-precision drafts lose agreement first. fp32 on CPU stores its
Linear weights transposed by default (see linear_layout.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from services.errors import PrecisionError
from services.models.int8_linear import quantise_linears
from services.models.linear_layout import LAYOUTS, restore_linears, transpose_linears

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
_FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Fp32Norm(nn.Module):
    """Wraps a norm layer: fp32 weights and math, output cast back to the input dtype."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner.float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden_states.float()).to(hidden_states.dtype)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def _keep_norms_fp32(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_norm(child):
                setattr(parent, name, Fp32Norm(child))


def lossless_warning(precision: str) -> str | None:
    """What a verify worker says at start when its target's greedy output may differ from target-only decoding
    (docs/decoding.md, "Reduced-precision targets"); None for fp32 and int8, which stay identical."""
    if precision in ("fp32", "int8"):
        return None
    return (f"target at {precision}: its logits for a token depend on what else a forward carries (a verified "
            f"block, a prefill chunk, a reused prefix), so greedy output may differ from target-only decoding; "
            f"serve fp32 or int8 where output must be identical (docs/decoding.md, reduced-precision targets)")


def apply_precision(model: nn.Module, precision: str, device: torch.device, *,
                    layout: str = "transposed") -> nn.Module:
    """Returns the model (possibly a new object) at `precision` on `device`, in eval mode.

    layout: "transposed" stores fp32 CPU Linear weights [in, out] (faster block verification), "native" as loaded."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if layout not in LAYOUTS:
        raise PrecisionError(f"unknown weight layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    transposed = precision == "fp32" and layout == "transposed" and device.type == "cpu"
    if not transposed:
        restore_linears(model)  # a copy of a transposed model: quantisation and casts want plain Linear layers
    model = model.to(device)
    if precision == "int8":
        if device.type != "cpu":
            raise PrecisionError(f"precision 'int8' (torch._int_mm on CPU) runs on CPU only, not {device}")
        model = quantise_linears(model.float())
    elif precision != "fp32":
        model = model.to(_FLOAT_DTYPES[precision])
        _keep_norms_fp32(model)
    else:
        model = model.float()
        if transposed:
            transpose_linears(model)  # only the plain layers: an already transposed copy stays as it is
    return model.eval()
