"""The checkpoint format's names and its ``checkpoint.json`` reader, without torch: what a bundle needs to
check the models it names (``coreply index info`` and ``verify`` stay fast). Loading and saving weights
is :mod:`coreply.checkpoint`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coreply.artifacts import Sealing, read_sealed

FORMAT = "coreply-checkpoint/2"
META = "checkpoint.json"
WEIGHTS = "model.safetensors"
ADAPTER = "adapter.safetensors"
KINDS = ("bi", "cross")  # a Poly-encoder is a "bi" checkpoint whose config has poly_codes > 0


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, malformed or does not match its recorded hashes."""


SEALING = Sealing(
    META,
    FORMAT,
    "content_hash",  # of the weights and the config, provenance and all
    CheckpointError,
    f"not a coreply checkpoint (no {META})",
    legacy="coreply-checkpoint/1",  # its content hash covered the files alone, not the config
)


def read_meta(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """Read and (by default) verify ``checkpoint.json`` against the files; raises :class:`CheckpointError`."""
    root = Path(path)
    meta = read_sealed(root, SEALING, verify)
    if meta.get("kind") not in KINDS:
        raise CheckpointError(f"{root / META}: unknown kind {meta.get('kind')!r}")
    return meta
