"""What a smaller reranker would cost: int8 ONNX latency of a MiniLM cross-encoder cut to its first k
layers, scoring 10 pairs padded to L tokens (timing only: the cut models are not trained).

    python bench/reranker_sizes.py
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from coreply.config import ModelConfig
from coreply.inference import OnnxBackend, export_onnx
from coreply.models import BiEncoder, CrossEncoder


def main() -> None:
    torch.manual_seed(0)
    bi = BiEncoder.from_pretrained(ModelConfig(share_towers=True, normalize=True))
    print("| layers | pair tokens | int8 ORT ms for 10 pairs (p50, 2 threads) |\n|---|---|---|")
    for layers in (6, 3, 2):
        for tokens in (128, 96, 64):
            cross = CrossEncoder.from_pretrained(
                ModelConfig(max_context_tokens=tokens - 31, max_response_tokens=32, num_layers=layers)
            ).eval()
            with tempfile.TemporaryDirectory() as tmp:
                export_onnx(bi, cross, Path(tmp))
                backend = OnnxBackend(Path(tmp), bi.tokenizer, cross.tokenizer, bi.dim, threads=2)
                context = [" ".join(["word"] * 200)]  # long enough to fill the context budget
                responses = [" ".join(["reply"] * 40)] * 10
                times = []
                for _ in range(12):
                    start = time.perf_counter()
                    backend.score_pairs([context] * 10, responses)
                    times.append(1000 * (time.perf_counter() - start))
            print(f"| {layers} | {tokens} | {np.median(times[2:]):.1f} |", flush=True)


if __name__ == "__main__":
    main()
