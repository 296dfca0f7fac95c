"""Inference backends behind one interface, so the index builder and the service run the same code on
PyTorch (the reference) and on ONNX Runtime (graphs exported from the same models, fp32 or dynamic int8).

Every backend returns float32 numpy arrays: context / response embeddings [N, D] and pair scores [N];
with a Poly-encoder retriever also the pooled context vector and its m codes together [N, 1 + m, D].
Inputs go through the one :class:`~coreply.tokenization.DialogueTokenizer`, in length-sorted chunks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from coreply.device import cpu_has_bf16_dot
from coreply.knowledge import KnowledgeSelector
from coreply.models import BiEncoder, CrossEncoder, PolyEncoder, batched, varlen_runs_on
from coreply.smoothing import ALPHA, calibration_pairs, smoothed
from coreply.tokenization import Batch, DialogueTokenizer, score_by_tokens

ONNX_FILES = {"context": "context.onnx", "response": "response.onnx", "cross": "cross.onnx"}
PRECISIONS = ("fp32", "int8")
INT8_VARIANTS: dict[str, dict[str, Any]] = {
    "int8-per-channel-7bit": {"per_channel": True, "reduce_range": True},  # weights in [-64, 63]
    "int8-per-channel": {"per_channel": True},  # one scale per output channel of each weight
    "int8-per-tensor": {},  # one scale per weight: small channels lose their precision
}
"""Options of ONNX Runtime's dynamic quantisation (int8 weights, activations quantised on the fly),
compared by ``bench/quantisation.py``. ``--onnx int8`` writes :data:`INT8`: per channel keeps the
default retriever's vectors at cosine 0.99 with fp32's where per tensor gives 0.95 (docs/results.md §16).
7-bit weights give the same answers on every x86 CPU: without VNNI (AVX2 only) ONNX Runtime sums pairs of
uint8 x int8 products in 16 bits, which saturate once weights pass 63. Trained MiniLM weights rarely get
there (the default retriever: cosine 0.992 with 8 bits, 0.990 with 7, on an AVX2 host), toy ones do
(a random linear layer 27-39 % off); docs/performance.md §12."""
INT8 = "int8-per-channel-7bit"
log = logging.getLogger(__name__)


class Backend(Protocol):
    name: str
    cpu_torch: bool  # its models run in PyTorch on the CPU: OpenMP teams (coreply.device.on_own_thread)
    dim: int
    has_cross: bool  # a cross-encoder reranker is loaded
    cross_tokenizer: DialogueTokenizer | None
    poly_codes: int  # m > 0 when the retriever is a Poly-encoder
    select_knowledge: KnowledgeSelector | None  # the bundle's knowledge retriever, if it has one

    @property
    def reads_knowledge(self) -> bool: ...

    def encode_contexts(self, contexts: Sequence[Sequence[str]]) -> np.ndarray: ...

    def encode_context_codes(self, contexts: Sequence[Sequence[str]]) -> np.ndarray: ...

    def encode_responses(self, responses: Sequence[str]) -> np.ndarray: ...

    def score_pairs(
        self,
        contexts: Sequence[Sequence[str]],
        responses: Sequence[str],
        knowledge: Sequence[Sequence[str]] | None = None,
    ) -> np.ndarray: ...


class _Knowledge:
    """What both backends say about knowledge: whether their reranker reads it, and who picks it."""

    cross_tokenizer: DialogueTokenizer | None
    select_knowledge: KnowledgeSelector | None = None

    @property
    def reads_knowledge(self) -> bool:
        return self.cross_tokenizer is not None and self.cross_tokenizer.config.max_knowledge_tokens > 0


class TorchBackend(_Knowledge):
    """The models themselves: bf16 autocast on CUDA (the same numerics as training); on a CPU fp32, or with
    ``bf16`` the weights cast to bf16 (faster than fp32 where the CPU has bf16 instructions:
    :func:`coreply.device.cpu_has_bf16_dot`). Outputs are float32 either way."""

    def __init__(
        self,
        bi: BiEncoder,
        cross: CrossEncoder | None,
        max_batch_tokens: int | None = None,
        bf16: bool = False,
        packed: bool | None = None,
    ) -> None:
        """Batches are the models' own, sized for their device (:func:`coreply.device.batch_scale`);
        ``max_batch_tokens`` overrides the reranker's padded tokens a batch. ``packed`` (default: on CUDA
        where PyTorch has variable-length attention) runs them without their padding. The models become
        the backend's: ``bf16`` casts them in place and ``packed`` is set on them, so pass copies of
        models used elsewhere."""
        self.name = "torch-bf16" if bf16 else "torch"
        if bf16 and bi.device.type == "cpu":  # CUDA already runs bf16 under autocast
            if not cpu_has_bf16_dot():
                log.warning(
                    "torch-bf16: this CPU has no bf16 instructions (AVX-512 BF16, AMX): bf16 is slow here"
                )
            bi, cross = bi.to(torch.bfloat16), cross.to(torch.bfloat16) if cross is not None else None
        self.bi, self.cross = bi, cross
        if packed is None:
            packed = varlen_runs_on(bi.device)
        for model in (bi, cross):
            if model is not None:
                model.packs = packed
        self.cpu_torch = bi.device.type == "cpu"
        self.max_batch_tokens = max_batch_tokens
        self.dim = bi.dim
        self.has_cross = cross is not None
        self.cross_tokenizer = cross.tokenizer if cross is not None else None
        self.poly_codes = bi.num_codes if isinstance(bi, PolyEncoder) else 0

    def encode_contexts(self, contexts: Sequence[Sequence[str]]) -> np.ndarray:
        return self.bi.embed_contexts(contexts).numpy()

    def encode_context_codes(self, contexts: Sequence[Sequence[str]]) -> np.ndarray:
        if not isinstance(self.bi, PolyEncoder):
            raise RuntimeError("this bundle's retriever is not a Poly-encoder")
        return self.bi.embed_context_codes(contexts).numpy()

    def encode_responses(self, responses: Sequence[str]) -> np.ndarray:
        return self.bi.embed_responses(responses).numpy()

    def score_pairs(
        self,
        contexts: Sequence[Sequence[str]],
        responses: Sequence[str],
        knowledge: Sequence[Sequence[str]] | None = None,
    ) -> np.ndarray:
        if self.cross is None:
            raise RuntimeError("this bundle has no reranker")
        return self.cross.score_pairs(contexts, responses, knowledge, self.max_batch_tokens).numpy()


# ------------------------------------------------------------------------------------------- export


class _ContextGraph(nn.Module):
    def __init__(self, bi: BiEncoder) -> None:
        super().__init__()
        self.bi = bi

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[N, L] x2 -> [N, D], or a Poly-encoder's [N, 1 + m, D] (pooled vector, then codes)"""
        batch = Batch(input_ids, attention_mask, torch.zeros_like(input_ids))
        if isinstance(self.bi, PolyEncoder):
            return self.bi.encode_context_codes(batch)
        return self.bi.encode_context(batch)


class _ResponseGraph(_ContextGraph):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[N, L] x2 -> [N, D]"""
        return self.bi.encode_response(Batch(input_ids, attention_mask, torch.zeros_like(input_ids)))


class _CrossGraph(nn.Module):
    def __init__(self, cross: CrossEncoder) -> None:
        super().__init__()
        self.cross = cross

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        """[N, L] x3 -> [N]"""
        return self.cross(Batch(input_ids, attention_mask, token_type_ids))


@contextmanager
def _eager_attention(module: nn.Module) -> Iterator[None]:
    """Trace attention as plain matmuls and softmax, then restore what the backbones used before.
    PyTorch's SDPA path traces into mask-cleaning IsNaN / Where ops over [N, heads, L, L] that ONNX
    Runtime runs unfused: measured on the 2-vCPU machine (6-layer MiniLM reranker, int8, 10 pairs of
    108 tokens) the eager graph is about 25 % faster, with the same scores (docs/performance.md §8)."""
    backbones = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    before = [b.config._attn_implementation for b in backbones]
    for backbone in backbones:
        backbone.set_attn_implementation("eager")
    try:
        yield
    finally:
        for backbone, implementation in zip(backbones, before, strict=True):
            backbone.set_attn_implementation(implementation)


def _export(module: nn.Module, example: Batch, inputs: list[str], path: Path) -> None:
    args = tuple(getattr(example, name) for name in inputs)
    axes = {name: {0: "batch", 1: "length"} for name in inputs} | {"output": {0: "batch"}}
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad(), _eager_attention(module):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            args,
            str(path),
            input_names=inputs,
            output_names=["output"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )


_SAMPLE_CONTEXTS = [["an example context", "with two turns"]] * 2  # what the exports trace
_SAMPLE_RESPONSES = ["an example response", "another"]
_TOWER_INPUTS = ["input_ids", "attention_mask"]


def export_onnx(
    bi: BiEncoder,
    cross: CrossEncoder | None,
    out_dir: Path,
    precision: str = "int8",
    calibration: Sequence[str] = (),
) -> dict[str, Any] | None:
    """Write ``context.onnx``, ``response.onnx`` and (with a reranker, :func:`export_reranker`)
    ``cross.onnx`` into ``out_dir``; ``int8``: int8 weights by :data:`INT8` (activations quantised on the
    fly), for CPU hosts. Returns how the reranker's graph was smoothed, or None."""
    _check_precision(precision)
    out_dir.mkdir(parents=True, exist_ok=True)
    bi = bi.cpu().eval()
    towers = {
        "context": (_ContextGraph(bi), bi.tokenizer.contexts(_SAMPLE_CONTEXTS)),
        "response": (_ResponseGraph(bi), bi.tokenizer.responses(_SAMPLE_RESPONSES)),
    }
    for name, (module, example) in towers.items():
        _write_graph(module, example, _TOWER_INPUTS, out_dir / ONNX_FILES[name], precision)
    return export_reranker(cross, out_dir / ONNX_FILES["cross"], precision, calibration) if cross else None


def export_reranker(
    cross: CrossEncoder, path: Path, precision: str = "int8", calibration: Sequence[str] = ()
) -> dict[str, Any] | None:
    """Write the reranker's graph to ``path``; ``int8``: from a copy smoothed on pairs of the
    ``calibration`` texts (a response pool; none: not smoothed, :mod:`coreply.smoothing`). Returns how it
    was smoothed, or None."""
    _check_precision(precision)
    path.parent.mkdir(parents=True, exist_ok=True)
    cross = cross.cpu().eval()
    contexts, responses = calibration_pairs(calibration) if precision == "int8" else ([], [])
    graph = smoothed(cross, contexts, responses)
    example = cross.tokenizer.pairs(_SAMPLE_CONTEXTS, _SAMPLE_RESPONSES)
    _write_graph(_CrossGraph(graph), example, [*_TOWER_INPUTS, "token_type_ids"], path, precision)
    return None if graph is cross else {"alpha": ALPHA, "pairs": len(contexts)}


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"onnx precision must be one of {PRECISIONS}, got {precision!r}")


def _write_graph(module: nn.Module, example: Batch, inputs: list[str], path: Path, precision: str) -> None:
    """``module`` traced on ``example`` to ``path``, its weights int8 (:data:`INT8`) unless ``fp32``."""
    if precision == "fp32":
        _export(module, example, inputs, path)
        return
    fp32 = path.with_name(f".{path.stem}.fp32.onnx")
    _export(module, example, inputs, fp32)
    quantize_graph(fp32, path)
    fp32.unlink()


def quantize_graph(fp32: Path, out: Path, variant: str = INT8, keep_fp32: Sequence[str] = ()) -> None:
    """Write ``fp32``'s graph with int8 weights to ``out``, by one of :data:`INT8_VARIANTS`; the nodes
    named in ``keep_fp32`` stay fp32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # ORT logs a preprocessing hint straight to the root logger: drop that (and only records logged to the
    # root itself, not those of named loggers) for this call, leaving the process's logging as it was.
    root = logging.getLogger()
    root.addFilter(_below_error)
    try:
        quantize_dynamic(
            str(fp32),
            str(out),
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(keep_fp32),
            **INT8_VARIANTS[variant],
        )
    finally:
        root.removeFilter(_below_error)


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


# ------------------------------------------------------------------------------------------ runtime


# ONNX Runtime's fused SkipLayerNormalization runs about 5 times slower on the CPU than the Add and
# LayerNormalization it replaces (on a 107-token row of 384: 305 us, LayerNormalization alone 45;
# docs/performance.md §20), so the reranker's graph runs them unfused there. The retrieval graphs keep
# the fusion: the vectors a bundle stores were encoded with it, and a query must be encoded as its pool.
UNFUSED_CROSS = ("SkipLayerNormFusion",)


def _session(
    path: Path, threads: int, cuda: bool, profile: Path | None = None, unfused: tuple[str, ...] = ()
):
    """An ONNX Runtime session as the service runs it; ``profile``: record per-node times to files with
    this prefix (``bench/rerank_ops.py``); ``unfused``: graph fusions left out."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Idle intra-op threads must not spin: in the service they share the cores with the event loop and
    # FAISS. Measured on the 2-vCPU dev machine (bench/bench.py, n_r = 10): p50 190 ms instead of 260 ms
    # at concurrency 1, and 5.7 instead of 3.8 requests/s at concurrency 4.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = ["CPUExecutionProvider"]
    if _on_cuda(cuda):
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), options, providers=providers, disabled_optimizers=list(unfused))


def _on_cuda(cuda: bool) -> bool:
    """Whether ``_session(..., cuda)`` runs its graph on CUDA: asked for, and ONNX Runtime has it."""
    import onnxruntime as ort

    return cuda and "CUDAExecutionProvider" in ort.get_available_providers()


class OnnxBackend(_Knowledge):
    """ONNX Runtime sessions over graphs written by :func:`export_onnx`; tokenisation is the models' own.

    On the CPU every row (a context, a response, a pair) runs alone, unpadded, spread over ``threads``
    caller threads. An int8 graph quantises its activations with one scale per call, so a row run in a
    batch comes out different with other company (top-1 changed for 10 of 64 contexts, the default
    bundle); alone, a row's result depends on that row only, so an answer does not depend on the other
    requests that share its micro-batch, and evaluation batches rank as the service does. It is also
    faster here: no padding, and the rows keep both cores busy (docs/performance.md §14). On CUDA batches
    run whole (fp32 graphs there: a row's result does not depend on its batch)."""

    def __init__(
        self,
        onnx_dir: Path,
        bi_tokenizer: DialogueTokenizer,
        cross_tokenizer: DialogueTokenizer | None,
        dim: int,
        threads: int = 1,
        batch_size: int = 64,
        cuda: bool = False,
        max_batch_tokens: int = 4096,
    ) -> None:
        self.name = "onnx"
        self.cpu_torch = False  # ONNX Runtime's own thread pools
        self.max_batch_tokens = max_batch_tokens
        self.dim = dim
        self.batch_size = batch_size
        self.bi_tokenizer, self.cross_tokenizer = bi_tokenizer, cross_tokenizer
        self.threads, self.cuda = threads, cuda
        self.on_cpu = not _on_cuda(cuda)
        # On the CPU rows are spread over `threads` callers, each on one intra-op thread: a row on one
        # thread is 10-25 % faster than on all of them, the same floats (docs/performance.md §19), and a
        # request's lone context no slower (§30).
        row_threads = 1 if self.on_cpu else threads
        self.context = _session(onnx_dir / ONNX_FILES["context"], row_threads, cuda)
        self.response = _session(onnx_dir / ONNX_FILES["response"], row_threads, cuda)
        cross_path = onnx_dir / ONNX_FILES["cross"]
        self.cross = self.cross_session(cross_path) if cross_tokenizer and cross_path.is_file() else None
        self.has_cross = self.cross is not None
        self.poly_codes = bi_tokenizer.config.poly_codes
        self.map_rows: Any = None  # (function, rows) -> results in order; None: batches run whole
        if self.on_cpu:
            self.map_rows = ThreadPoolExecutor(threads, "onnx-rows").map if threads > 1 else map

    def cross_session(self, path: Path, profile: Path | None = None):
        """A reranker graph's session as this backend runs pairs: on the CPU a pair a thread, unfused."""
        if not self.on_cpu:
            return _session(path, self.threads, self.cuda, profile)
        return _session(path, 1, cuda=False, profile=profile, unfused=UNFUSED_CROSS)

    def _run(self, session, batch: Batch) -> torch.Tensor:
        """The graph's outputs for a right-padded ``batch``: [N, ...], each row run alone on the CPU."""
        feeds = {i.name: getattr(batch, i.name).numpy() for i in session.get_inputs()}
        if self.map_rows is None:
            return torch.from_numpy(session.run(None, feeds)[0])
        lengths = batch.attention_mask.sum(dim=1).tolist()

        def row(i: int) -> np.ndarray:
            return session.run(None, {name: x[i : i + 1, : lengths[i]] for name, x in feeds.items()})[0]

        rows = map if len(lengths) == 1 else self.map_rows  # one row: no hand-over to a worker
        return torch.from_numpy(np.concatenate(list(rows(row, range(len(lengths))))))

    def _context_graph(self, contexts: Sequence[Sequence[str]]) -> np.ndarray:
        """[N, D], or a Poly-encoder's [N, 1 + m, D] (the pooled vector first, then the codes)."""
        tok = self.bi_tokenizer
        return batched(contexts, self.batch_size, lambda c: self._run(self.context, tok.contexts(c))).numpy()

    def encode_context_codes(self, contexts: Sequence[Sequence[str]]) -> np.ndarray:
        if not self.poly_codes:
            raise RuntimeError("this bundle's retriever is not a Poly-encoder")
        return self._context_graph(contexts)

    def encode_contexts(self, contexts: Sequence[Sequence[str]]) -> np.ndarray:
        out = self._context_graph(contexts)
        return np.ascontiguousarray(out[:, 0]) if self.poly_codes else out

    def encode_responses(self, responses: Sequence[str]) -> np.ndarray:
        tok = self.bi_tokenizer
        run = lambda chunk: self._run(self.response, tok.responses(chunk))  # noqa: E731
        return batched(responses, 2 * self.batch_size, run).numpy()

    def score_pairs(
        self,
        contexts: Sequence[Sequence[str]],
        responses: Sequence[str],
        knowledge: Sequence[Sequence[str]] | None = None,
    ) -> np.ndarray:
        if self.cross is None or self.cross_tokenizer is None:
            raise RuntimeError("this bundle has no reranker")
        session = self.cross
        run = lambda batch: self._run(session, batch).numpy()  # noqa: E731
        tok = self.cross_tokenizer
        return score_by_tokens(tok, contexts, responses, self.max_batch_tokens, run, knowledge)
