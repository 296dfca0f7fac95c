"""The one place where the compute device is chosen."""

from __future__ import annotations

import torch


def resolve_device(preference: str = "auto") -> torch.device:
    """Map ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` to a device; ``auto`` takes CUDA when present."""
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(preference)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {preference!r} requested but CUDA is not available")
    return device


def autocast(device: torch.device):
    """bf16 autocast on CUDA, a no-op (fp32) on CPU."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
