"""Device readings for heartbeats: CPU via psutil, GPU via nvidia-ml-py when present,
and an override (Redis key with an expiry) so tests and drills can inject readings."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import psutil

logger = logging.getLogger(__name__)

OVERRIDE_FIELDS = ("utilization", "temperature_c", "memory_used_frac")


@dataclass(frozen=True)
class Reading:
    device_kind: str  # "cpu" | "cuda"
    utilization: float  # 0..1
    memory_used_frac: float  # 0..1
    temperature_c: float | None  # None where the kernel exposes nothing
    overridden: tuple[str, ...] = field(default_factory=tuple)


def _cpu_temperature() -> float | None:
    sensors = getattr(psutil, "sensors_temperatures", lambda: {})() or {}
    values = [entry.current for entries in sensors.values() for entry in entries if entry.current]
    return max(values) if values else None


def _gpu_reading(index: int) -> Reading | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        temperature = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        return Reading("cuda", utilization, memory.used / memory.total, float(temperature))
    except Exception:  # no driver, no device: report the CPU instead
        logger.debug("NVML unavailable", exc_info=True)
        return None


def read_device(device: str, *, report_as: str | None = None) -> Reading:
    """`report_as` (worker.device_kind) renames the device kind only: a CPU box can stand in for an
    accelerator pool in a drill, while utilization and memory stay real."""
    reading = None
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        reading = _gpu_reading(index)
    if reading is None:
        reading = Reading("cpu", psutil.cpu_percent(interval=None) / 100.0, psutil.virtual_memory().percent / 100.0,
                          _cpu_temperature())
    return replace(reading, device_kind=report_as) if report_as else reading


def apply_override(reading: Reading, override: dict | None, now: float | None = None) -> Reading:
    """Injected values win until their `expires_at`."""
    if not override or override.get("expires_at", 0) < (now if now is not None else time.time()):
        return reading
    values = {name: float(override[name]) for name in OVERRIDE_FIELDS if override.get(name) is not None}
    if "device_kind" in override:
        values["device_kind"] = override["device_kind"]
    return replace(reading, **values, overridden=tuple(sorted(values)))
