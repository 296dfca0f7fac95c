"""Packed input (``Batch.packed``): the models run only the real tokens and score as on padded batches."""

import pytest
import torch

import coreply.models as models
from coreply.config import ModelConfig
from coreply.models import BiEncoder, CrossEncoder, PolyEncoder
from coreply.tokenization import pad_rows

CONTEXTS = [["hello", "how are you ?"], ["pizza or pasta tonight ?"], ["hi"]]
RESPONSES = ["i am fine , thanks", "pasta", "hello there , how was your day ?"]


def test_packing_lists_the_real_tokens_row_after_row():
    batch = pad_rows([[5, 6, 7], [8], [9, 10]], pad=0, segment_starts=[1, 1, 1])
    packed = batch.packed()
    assert packed.packing.index.tolist() == [0, 1, 2, 3, 6, 7]  # [3, 3] flat positions
    assert packed.packing.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.packing.cu_seqlens.dtype == torch.int32 and packed.packing.max_len == 3
    assert batch.computed_tokens == 9 and packed.computed_tokens == packed.tokens == 6
    moved = packed.to(torch.device("cpu"))
    assert torch.equal(moved.packing.index, packed.packing.index) and moved.packing.max_len == 3


def scores(model, packed: bool):
    if isinstance(model, CrossEncoder):
        batch = model.tokenizer.pairs(CONTEXTS, RESPONSES)
        return [model(batch.packed() if packed else batch)]
    ctx, resp = model.tokenizer.contexts(CONTEXTS), model.tokenizer.responses(RESPONSES)
    return list(model(ctx.packed(), resp.packed()) if packed else model(ctx, resp))


def models_of(tiny_model_dir):
    torch.manual_seed(0)
    config = ModelConfig(base_model=str(tiny_model_dir), dropout=0.0)
    return [
        BiEncoder.from_pretrained(config),
        PolyEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), poly_codes=3)),
        CrossEncoder.from_pretrained(config),
        CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), cross_head="match")),
    ]


@pytest.mark.parametrize("index", range(4))
def test_packed_input_scores_and_trains_like_padded(tiny_model_dir, index):
    model = models_of(tiny_model_dir)[index]
    model.eval()  # no dropout: the same scores and gradients to the rounding
    with torch.no_grad():
        for want, got in zip(scores(model, False), scores(model, True), strict=True):
            assert torch.allclose(got, want, atol=1e-5)
    grads = []
    for packed in (False, True):
        model.zero_grad()
        sum(out.sum() for out in scores(model, packed)).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads, strict=True))


def test_packed_attention_drops_probabilities_as_padded_attention_does_in_training(tiny_model_dir):
    """Where ``varlen_attn`` does not run (a CPU), a packed batch is the padded model in training too: its
    attention drops probabilities at the backbone's rate, so the two paths' outputs are one distribution.
    Only attention dropout is left on: 400 draws of each spread alike and agree in the mean."""
    torch.manual_seed(0)
    cross = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), dropout=0.0))
    for name, module in cross.named_modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.3 if name.endswith("attention.self.dropout") else 0.0
    batch = cross.tokenizer.pairs(CONTEXTS, RESPONSES)
    cross.train()
    with torch.no_grad():
        draws = {
            packed: torch.stack([cross(batch.packed() if packed else batch) for _ in range(400)])
            for packed in (False, True)
        }
    spread = {packed: d.std(0) for packed, d in draws.items()}  # [3]; without dropout it would be 0
    assert (spread[False] > 0).all() and ((spread[True] / spread[False] - 1).abs() < 0.2).all()
    assert ((draws[True].mean(0) - draws[False].mean(0)).abs() < 5 * spread[False] / 20).all()  # 5 SE


def test_variable_length_attention_gets_each_rows_tokens_as_one_sequence(tiny_model_dir, monkeypatch):
    # what CUDA runs (torch's varlen_attn), replaced by a reference with its contract: q, k, v [T, heads,
    # width], the rows' starts among the T tokens, and the longest row
    calls = []

    def reference(q, k, v, cu_q, cu_k, max_q, max_k):
        assert q.shape == k.shape == v.shape and q.dim() == 3 and torch.equal(cu_q, cu_k) and max_q == max_k
        calls.append(cu_q.tolist())
        out = torch.empty_like(q)
        for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            assert end - start <= max_q
            rows = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [heads, len, width]
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(*rows).transpose(0, 1)
        return out

    cross = models_of(tiny_model_dir)[2].eval()
    batch = cross.tokenizer.pairs(CONTEXTS, RESPONSES)
    with torch.no_grad():
        want = cross(batch)
        monkeypatch.setattr(models, "varlen_attn", reference)
        monkeypatch.setattr(models, "_varlen_ready", lambda q: True)
        got = cross(batch.packed())
    assert len(calls) == len(cross.backbone.encoder.layer)
    assert calls[0] == batch.packed().packing.cu_seqlens.tolist()
    assert torch.allclose(got, want, atol=1e-5)


def test_the_torch_backend_packs_only_where_asked_or_on_cuda_and_answers_alike(tiny_model_dir, monkeypatch):
    from coreply.inference import TorchBackend
    from coreply.tokenization import Batch

    bi, _, cross, _ = (m.eval() for m in models_of(tiny_model_dir))
    assert not TorchBackend(bi, cross).bi.packs  # the CPU default: padded batches (nothing to gain)
    packings, pack = [], Batch.packed
    monkeypatch.setattr(Batch, "packed", lambda self: packings.append(1) or pack(self))
    answers = []
    for packed in (False, True):
        backend = TorchBackend(bi, cross, packed=packed)
        assert bi.packs == cross.packs == packed
        packings.clear()
        answers.append(
            [
                backend.encode_contexts(CONTEXTS),
                backend.encode_responses(RESPONSES),
                backend.score_pairs(CONTEXTS, RESPONSES),
            ]
        )
        assert len(packings) == (3 if packed else 0)  # contexts, responses, pairs: one batch each
    assert all(abs(a - b).max() < 1e-5 for a, b in zip(*answers, strict=True))
