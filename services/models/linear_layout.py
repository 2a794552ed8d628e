"""Linear weights stored transposed for CPU inference: one layout that is fast for 1 token and for a block.

`nn.Linear` computes x @ W.T with W stored [out, in]. For a single row
(autoregressive decoding) MKL's fp32 kernels are fine either way, but from
4 rows on (verifying a draft block) its x @ W.T path is 2-10x slower than
x @ W_t with W_t stored [in, out] contiguous, on this project's 2-core
Xeon: one 576x576 projection over 5 rows 0.21 ms vs 0.017 ms, the 49152-word
head 11.6 ms vs 8.7 ms. Over the whole SmolLM2-135M forward that is
110 -> 79 ms for 5 tokens and 134 -> 98 ms for 9, 1 token about the same,
2-3 tokens 6-10 ms dearer (`mirror-sd models profile --layout native,transposed`). Same weights, same math: only
the memory layout differs, so outputs agree to float rounding and greedy
output stays identical to target-only decoding (tested).

A transposed layer keeps nn.Linear's face for readers: `.weight` is the
[out, in] view and its state dict holds `weight`, so code that copies layers
or reads the head (distillation) works unchanged. A head tied to the input
embeddings (SmolLM2's) becomes its own transposed copy: +108 MiB fp32 for a
49152 x 576 vocabulary. Assigning `.weight` (transformers' tie_weights does)
stores a transposed copy of the new weight.
"""

from __future__ import annotations

import torch
from torch import nn

LAYOUTS = ("transposed", "native")


class TransposedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)  # [in, out]
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight nn.Linear would hold (a view)."""
        return self.weight_t.t()

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":  # nn.Module would register a second parameter; keep one, transposed
            self.weight_t = nn.Parameter(value.detach().t().contiguous(), requires_grad=False)
            return
        super().__setattr__(name, value)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = torch.matmul(inputs, self.weight_t)
        return outputs if self.bias is None else outputs + self.bias

    def to_linear(self) -> nn.Linear:
        linear = nn.utils.skip_init(nn.Linear, self.in_features, self.out_features, bias=self.bias is not None,
                                    device=self.weight_t.device, dtype=self.weight_t.dtype)
        linear.weight = nn.Parameter(self.weight.contiguous(), requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        weight = self.weight if keep_vars else self.weight.detach()
        destination[prefix + "weight"] = weight.contiguous()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """As nn.Linear loads: `weight` [out, in] and `bias` [out], shapes checked, strays reported."""
        expected = {"weight": (self.out_features, self.in_features)}
        if self.bias is not None:
            expected["bias"] = (self.out_features,)
        for name, shape in expected.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if tuple(value.shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                  f"the shape in current model is {shape}")
                continue
            with torch.no_grad():
                (self.weight_t if name == "weight" else self.bias).copy_(value.t() if name == "weight" else value)
        if strict:
            unexpected_keys.extend(key for key in state_dict if key.startswith(prefix)
                                   and "." not in key[len(prefix):] and key[len(prefix):] not in expected)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, transposed"


def replace_layers(model: nn.Module, wanted: type, convert) -> int:
    """Converts every `wanted` layer in place, one at a time: only names are listed up front, so each old
    layer is freed as soon as its replacement is in (a list of the modules themselves would keep every old
    layer alive to the end, and a model's weights twice in memory: 12 GB at the peak for a 1B fp32 model).
    A layer registered in two places is converted once and stays shared."""
    locations = [name for name, module in model.named_modules(remove_duplicate=False)
                 if name and type(module) is wanted]
    converted: dict[int, nn.Module] = {}
    for location in locations:
        parent_name, _, attribute = location.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, attribute)
        replacement = converted.get(id(child))
        if replacement is None:
            replacement = converted[id(child)] = convert(child)
        setattr(parent, attribute, replacement)
        del child
    return len(converted)


def transpose_linears(model: nn.Module) -> int:
    """Store every plain nn.Linear of model transposed (in place); returns how many."""
    return replace_layers(model, nn.Linear, TransposedLinear)


def restore_linears(model: nn.Module) -> int:
    """Back to plain nn.Linear layers (before quantisation or a dtype change); returns how many."""
    return replace_layers(model, TransposedLinear, TransposedLinear.to_linear)
