"""CUDA-only checks: the same code gives the same scores on CPU (fp32) and GPU (bf16 autocast), and a bf16
CORE step runs."""

import pytest
import torch

from coreply.config import ModelConfig
from coreply.models import BiEncoder, CrossEncoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cpu_and_cuda_scores_agree(tiny_model_dir):
    config = ModelConfig(base_model=str(tiny_model_dir))
    contexts, responses = [["hello", "how are you ?"]] * 2, ["i am fine", "pizza"]
    for cls in (BiEncoder, CrossEncoder):
        torch.manual_seed(0)
        model = cls.from_pretrained(config).eval()
        if cls is BiEncoder:
            cpu = model.embed_contexts(contexts) @ model.embed_responses(responses).T
            model.cuda()
            gpu = model.embed_contexts(contexts) @ model.embed_responses(responses).T
        else:
            cpu = model.score_pairs(contexts, responses)
            model.cuda()
            gpu = model.score_pairs(contexts, responses)
        assert torch.allclose(cpu, gpu, atol=2e-2, rtol=2e-2)  # bf16 on the GPU


def test_core_step_with_bf16_autocast_on_cuda(tmp_path, tiny_model_dir, toy_pairs):
    from training.config import TrainConfig
    from training.trainer import Trainer

    cfg = TrainConfig(
        mode="core",
        output_dir=str(tmp_path),
        model=ModelConfig(base_model=str(tiny_model_dir)),
        num_negatives=3,
        batch_size=4,
        max_steps=2,
        device="cuda",
        valid_size=0,
    )
    trainer = Trainer(cfg, toy_pairs, [], sorted({p.response for p in toy_pairs}))
    losses = trainer.reduce_losses(trainer.train_step(0, 0))
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert trainer.device.type == "cuda"


@pytest.mark.parametrize("packed_train", [False, True])
def test_packed_input_runs_variable_length_attention_and_scores_like_padded(tiny_model_dir, packed_train):
    import coreply.models as models
    from coreply.device import autocast

    if models.varlen_attn is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    cross = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), dropout=0.0)).cuda()
    batch = cross.tokenizer.pairs([["hello", "how are you ?"], ["hi"]] * 4, ["i am fine", "pizza"] * 4)
    cross.train(packed_train)
    cuda = torch.device("cuda")
    with autocast(cuda):
        padded, packed = cross(batch.to(cuda)), cross(batch.packed().to(cuda))
    if packed_train:
        packed.sum().backward()  # FlashAttention's backward over packed rows
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in cross.parameters())
    else:
        assert torch.allclose(packed.float(), padded.float(), atol=3e-2)


def test_bundle_built_on_cuda_serves_like_cpu(tmp_path, tiny_core, toy_pairs):
    """Pool encoded on CUDA (bf16 autocast) and served on CUDA ranks like the CPU reference."""
    import numpy as np
    from conftest import toy_pool
    from fastapi.testclient import TestClient

    from coreply.bundle import load_bundle
    from index_builder.build import build_bundle
    from service.app import create_app
    from service.settings import Settings

    build = dict(bi=str(tiny_core / "bi"), cross=str(tiny_core / "cross"), onnx="none", progress=False)
    build_bundle(tmp_path / "gpu", toy_pool(), device="cuda", **build)
    build_bundle(tmp_path / "cpu", toy_pool(), device="cpu", **build)
    gpu, cpu = load_bundle(tmp_path / "gpu"), load_bundle(tmp_path / "cpu")
    assert gpu.manifest["encoder"] == "torch-cuda"
    vectors = [b.index.reconstruct_n(0, b.index.ntotal) for b in (gpu, cpu)]
    np.testing.assert_allclose(vectors[0], vectors[1], atol=0.05)  # bf16 vs fp32
    question = toy_pairs[0].context
    answers = []
    for name, device in (("gpu", "cuda"), ("cpu", "cpu")):
        with TestClient(create_app(Settings(bundle=tmp_path / name, threads=1, device=device))) as c:
            body = c.post("/respond", json={"context": list(question), "fusion": "sum"}).json()
            answers.append(body["responses"][0]["text"])
    assert answers[0] == answers[1] == toy_pairs[0].response


def test_exact_search_on_cuda_returns_what_faiss_returns():
    from test_index_builder.test_build import flat_index_and_queries

    from coreply.bundle import TorchExactIndex

    index, queries = flat_index_and_queries()
    want_scores, want_ids = index.search(queries, 10)
    got_scores, got_ids = TorchExactIndex.of(index, "cuda").search(queries, 10)
    assert (got_ids == want_ids).mean() > 0.95  # TF32 / reduction order may swap near-ties
    assert abs(got_scores - want_scores).max() < 1e-2
