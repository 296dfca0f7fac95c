"""Checkpoint format: a directory with ``model.safetensors``, ``tokenizer/`` and ``checkpoint.json``
(kind, model config, backbone config, sha256 of every file, and a content hash over them). No pickle.
Writes are atomic (temporary directory renamed into place); loads verify every hash first.

A model trained with adapters (``coreply.adapters``) is saved compactly instead: ``adapter.safetensors``
holds only what training changed, and ``checkpoint.json`` names the base model's weights by sha256;
loading rebuilds the base, verifies it, applies the adapters and merges them into plain weights."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer

from coreply.adapters import adapter_state, add_lora, lora_settings, merge_lora, trainable_state
from coreply.artifacts import seal, sha256_file, staging
from coreply.checkpoint_meta import ADAPTER, META, SEALING, WEIGHTS, CheckpointError, read_meta
from coreply.config import ZERO_SHOT, ModelConfig
from coreply.models import BiEncoder, CrossEncoder, resolve_base_model, retriever_class
from coreply.tokenization import DialogueTokenizer


def model_class(kind: str, config: ModelConfig) -> type[BiEncoder] | type[CrossEncoder]:
    return retriever_class(config) if kind == "bi" else CrossEncoder


def save_weights(model: nn.Module, path: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Deterministic safetensors of ``state`` (default: the whole state dict): tensors that alias another
    (shared towers) are stored once, under the first name in sorted order, so equal weights always give
    equal bytes (and equal hashes)."""
    seen: set[tuple[int, int]] = set()
    tensors = {}
    for name, tensor in sorted((model.state_dict() if state is None else state).items()):
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor.detach().cpu().contiguous()
    save_file(tensors, str(path))
    path.chmod(0o644)  # safetensors writes 0600; a server running as another user must read it


def load_weights(model: nn.Module, path: Path, expected: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Load :func:`save_weights` output; every tensor of ``expected`` (default: the state dict) must be
    stored or alias a stored one, and nothing the model lacks may be stored. A stored tensor of the model
    beyond ``expected`` is loaded too: a compact checkpoint keeps frozen embedding tables that way
    (:func:`coreply.adapters.extract_lora`). Returns the names of those beyond ``expected``."""
    tensors = load_file(str(path))
    _, unexpected = model.load_state_dict(tensors, strict=False)
    params = model.state_dict(keep_vars=True)
    stored = {id(params[name]) for name in tensors if name in params}
    wanted = params if expected is None else expected
    really_missing = [k for k in wanted if k not in tensors and id(params[k]) not in stored]
    if really_missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not fit the config (missing={really_missing}, unexpected={unexpected})"
        )
    return sorted(name for name in tensors if name not in wanted)


def save_checkpoint(
    model: BiEncoder | CrossEncoder, path: str | Path, extra: dict[str, Any] | None = None
) -> str:
    """Save ``model`` to directory ``path`` atomically; returns its content hash.
    ``extra`` is free-form provenance (training command, metrics) stored in ``checkpoint.json``."""
    final = Path(path)
    with staging(final, META) as tmp:
        adapter = lora_settings(model)
        if adapter is None:
            save_weights(model, tmp / WEIGHTS)
            model.tokenizer.hf.save_pretrained(str(tmp / "tokenizer"))
        else:  # compact: the base model supplies the frozen weights and the tokenizer
            save_weights(model, tmp / ADAPTER, adapter_state(model))
            base = base_weights(model.config)
            adapter["base_sha256"] = sha256_file(base)
            adapter["base_fp16_sha256"] = fp16_fingerprint(base)
        meta = {
            "kind": model.kind,
            "model_config": model.config.to_dict(),
            "backbone_config": model.backbone_config(),
            "extra": extra or {},
        }
        if adapter is not None:
            meta["adapter"] = adapter
        return seal(tmp, final, SEALING, meta)["content_hash"]


def base_weights(config: ModelConfig) -> Path:
    """The safetensors file of the base model an adapter checkpoint builds on."""
    path = resolve_base_model(config.base_model) / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"base model {config.base_model!r} has no model.safetensors for adapters")
    return path


def fp16_fingerprint(weights: Path) -> str:
    """sha256 of a safetensors file's tensors rounded to fp16 (by name, with shapes): the identity of a
    base model at the precision adapters care about. A base carried to a GPU host in fp16 (half the
    bytes) and the original fp32 file have the same fingerprint, so adapters trained on either load on
    both; any real change of the weights changes it."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(weights), framework="pt") as fh:
        for name in sorted(fh.keys()):
            tensor = fh.get_tensor(name)
            digest.update(f"{name}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.to(torch.float16).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _load_adapter(root: Path, meta: dict[str, Any], config: ModelConfig) -> BiEncoder | CrossEncoder:
    """Base model (verified by its fp16 fingerprint, or for older checkpoints by the file's sha256) +
    the stored adapters, not yet merged."""
    adapter = meta["adapter"]
    if not isinstance(adapter, dict) or not {"rank", "alpha", "base_sha256"} <= set(adapter):
        raise CheckpointError(f"{root / META}: 'adapter' needs rank, alpha and base_sha256")
    base = base_weights(config)
    if "base_fp16_sha256" in adapter:
        same = fp16_fingerprint(base) == adapter["base_fp16_sha256"]
    else:
        same = sha256_file(base) == adapter["base_sha256"]
    if not same:
        raise CheckpointError(
            f"{root}: its adapters were trained on a different {config.base_model!r} base model than "
            f"{base} (fingerprint mismatch); install the base model the checkpoint names"
        )
    model = model_class(meta["kind"], config).from_pretrained(config)
    add_lora(model, int(adapter["rank"]), float(adapter["alpha"]))
    model.kept_whole = load_weights(model, root / ADAPTER, trainable_state(model))  # saved again as loaded
    return model


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", expect: str | None = None, merge: bool = True
) -> BiEncoder | CrossEncoder:
    """Load a verified checkpoint in eval mode; ``expect`` ('bi' or 'cross') refuses the other kind.
    Adapters are merged into plain weights unless ``merge`` is False (to resume training them)."""
    root = Path(path)
    meta = read_meta(root)
    if expect is not None and meta["kind"] != expect:
        raise CheckpointError(f"{root}: is a {meta['kind']}-encoder checkpoint, expected a {expect}-encoder")
    config = ModelConfig.from_dict(meta["model_config"])
    if "adapter" in meta:
        model = _load_adapter(root, meta, config)
        if merge:
            merge_lora(model)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
        model = model_class(meta["kind"], config).from_backbone_config(
            config, meta["backbone_config"], tokenizer
        )
        load_weights(model, root / WEIGHTS)
    model.content_hash = meta["content_hash"]
    return model.to(device).eval()


def load_bi(spec: str | Path, device: str | torch.device = "cpu") -> BiEncoder:
    """A bi-encoder checkpoint, or ``zero-shot``: all-MiniLM-L6-v2 as published (shared towers, mean
    pooling, cosine)."""
    if str(spec) == ZERO_SHOT:
        return BiEncoder.from_pretrained(ModelConfig(share_towers=True, normalize=True)).to(device).eval()
    return load_checkpoint(spec, device, expect="bi")  # type: ignore[return-value]


def load_dialogue_tokenizer(path: str | Path) -> DialogueTokenizer:
    """The input formatting of a checkpoint without loading its weights (for ONNX serving)."""
    meta = read_meta(path, verify=False)
    config = ModelConfig.from_dict(meta["model_config"])
    source = resolve_base_model(config.base_model) if "adapter" in meta else Path(path) / "tokenizer"
    return DialogueTokenizer(AutoTokenizer.from_pretrained(str(source)), config)
