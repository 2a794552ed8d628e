"""cpu_weight_layout "auto": the fp32 CPU weight layout this machine runs faster, measured once and kept.

Which layout is faster depends on the CPU and its BLAS kernels, not on the
model alone (services/models/linear_layout.py). SmolLM2-135M, one thread,
whole forward in ms for 1 / 3 / 5 / 9 tokens of one row:
- a 2-core Xeon (the layout's origin): native 1 token about even, 5 tokens
  110 vs transposed 79, 9 tokens 134 vs 98;
- a 2-core Xeon with AMX: native 67 / 72 / 112 / 148, transposed 55 / 126 /
  133 / 145: there the transposed layout's kernel for more than one row
  reads the weights at a third of the speed, and a draft block costs what
  2.4 plain tokens do.
So a worker measures both on the model it serves (a forward of 1, 3, 5 and
9 tokens, each the fastest of a few passes taking turns between the two) and
keeps the one with the smaller sum: plain decoding, short and long blocks
alike. The choice is cached beside the device profiles, keyed by the model,
threads, torch and the CPU (services/engine/profile.py). Models under
MIN_PARAMS (the tests' tiny ones) keep the transposed layout unmeasured.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from services.models.engine import TorchEngine
from services.models.loading import LoadedModel
from services.models.linear_layout import restore_linears, transpose_linears
from services.models.precision import apply_precision

logger = logging.getLogger(__name__)

LAYOUT_SIZES = (1, 3, 5, 9)  # tokens of one row: plain decoding, short and long blocks
MIN_PARAMS = 20_000_000
LAYOUT_FORMAT = 1


def faster_layout(timings: dict[str, dict[int, float]]) -> str:
    """The layout whose forwards over LAYOUT_SIZES sum to less (ties: transposed, the long-standing one)."""
    totals = {layout: sum(by_size.values()) for layout, by_size in timings.items()}
    return min(sorted(totals, key=lambda layout: layout != "transposed"), key=totals.__getitem__)


def _tied_head(model: nn.Module) -> bool:
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embeddings is not None and head.weight.data_ptr() == embeddings.weight.data_ptr()


def measure_layouts(native: LoadedModel, repeats: int = 3) -> dict[str, dict[int, float]]:
    """Ms of a forward of each LAYOUT_SIZES tokens (64 of context), native as loaded against transposed, the
    fastest of `repeats` passes that take turns between the two.

    One copy of the weights: the model is switched between the layouts in place, layer by layer (a transposed
    copy beside it would hold a 1B fp32 model's 6 GB twice). The passes go native-transposed,
    transposed-native, ..., so each costs one switch and neither layout always goes first. The model is
    left native, its head tied again if it was."""
    from services.engine.profile import _prefilled, _time_step_once

    model = native.model
    tied = _tied_head(model)
    layouts = ("native", "transposed")
    timings: dict[str, dict[int, list[float]]] = {layout: {n: [] for n in LAYOUT_SIZES} for layout in layouts}
    try:
        for index in range(repeats + 1):  # the first pass warms up
            for layout in layouts if index % 2 == 0 else layouts[::-1]:
                (transpose_linears if layout == "transposed" else restore_linears)(model)
                engine = TorchEngine(native)  # an engine holds the layers it found: a new one after a switch
                sequences = _prefilled(engine, 1, 64)
                try:
                    for n in LAYOUT_SIZES:
                        timings[layout][n].append(_time_step_once(engine, sequences, n))
                finally:
                    for sequence in sequences:
                        sequence.release()
                del engine, sequences
    finally:
        restore_linears(model)
        if tied:
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return {layout: {n: round(min(values[1:]), 3) for n, values in by_size.items()}
            for layout, by_size in timings.items()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def resolve_layout(model: nn.Module, name: str, tokenizer, *, precision: str, device: torch.device,
                   layout: str, cache_dir: Path | None) -> str:
    """`layout` as given, or for "auto" the faster one here (see the module docstring); fp32 on the CPU only
    has a layout to choose."""
    if layout != "auto":
        return layout
    if precision != "fp32" or device.type != "cpu":
        return "native"
    if sum(parameter.numel() for parameter in model.parameters()) < MIN_PARAMS:
        return "transposed"
    from services.engine.profile import _cached, _key, _model_facts

    native = LoadedModel(name, apply_precision(model, "fp32", device, layout="native"), tokenizer, "fp32", device,
                         "native")
    facts = {**_model_facts(native), "layout": None, "format": LAYOUT_FORMAT, "threads": torch.get_num_threads(),
             "torch": torch.__version__, "cpu": _cpu_name(), "sizes": list(LAYOUT_SIZES)}
    path = None if cache_dir is None else Path(cache_dir) / "profiles" / f"layout-{_key(facts)}.json"

    def measure() -> dict[str, float]:
        return {f"{layout}_ms_{n}": ms for layout, by_size in measure_layouts(native).items()
                for n, ms in by_size.items()}

    # kept even when measured under load (threads 0: no share test): the passes take turns between the two
    # layouts, so a busy machine slows both alike and the choice, a ratio, stands; a process measuring it again
    # on every load would cost each start seconds, and two of them could choose differently
    flat = _cached(path, "weight layout", measure, 0)
    timings = {layout: {n: flat[f"{layout}_ms_{n}"] for n in LAYOUT_SIZES} for layout in ("native", "transposed")}
    chosen = faster_layout(timings)
    logger.info("weight layout %s for %s here (ms for %s tokens: native %s, transposed %s)", chosen, name,
                "/".join(map(str, LAYOUT_SIZES)), "/".join(f"{timings['native'][n]:.0f}" for n in LAYOUT_SIZES),
                "/".join(f"{timings['transposed'][n]:.0f}" for n in LAYOUT_SIZES))
    return chosen
