"""CUDA-only checks: the same code gives the same scores on CPU and GPU, and a bf16 CORE step runs."""

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
        assert torch.allclose(cpu, gpu, atol=1e-3, rtol=1e-3)


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
    losses = trainer.train_step(0, 0)
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert trainer.device.type == "cuda"
