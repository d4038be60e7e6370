"""Device facts in one place: which device, which dtype, how much memory. steadylm reads no
environment variables today; any it comes to need are read here and only here."""

from __future__ import annotations

import os

import torch

from steadylm.config import ModelConfig, parse_dtype
from steadylm.errors import ConfigError
from steadylm.memory import DeviceMemory


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={name!r} but CUDA is not available; use device='cpu'", param="device"
        )
    return dev


def resolve_dtype(name: str, mc: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on CUDA and float32 on CPU, where fp32 matmuls are the
    fastest kind this hardware has (bf16/fp16 GEMMs are emulated on most x86 CPUs)."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.float32
    dtype = parse_dtype(mc.torch_dtype if mc.torch_dtype in ("float16", "bfloat16") else "bfloat16")
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16
    return dtype


def device_memory(device: torch.device) -> DeviceMemory:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(torch.cuda.get_device_name(device), total, free)
    total, avail = _meminfo()
    return DeviceMemory("cpu", total, avail)


def _meminfo() -> tuple[int, int]:
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except OSError:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages
    return info["MemTotal"], info.get("MemAvailable", info["MemFree"])


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
