import json
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

import training.trainer as trainer_module
from coreply.adapters import trainable_state
from coreply.checkpoint import load_checkpoint
from coreply.config import ModelConfig
from coreply.corpus import NegativeSampler
from coreply.text import normalize
from evaluation.protocols import recall_pool
from training.config import RESUMABLE, TrainConfig
from training.losses import kl_to_target, listwise_ce
from training.sampling import HardNegativeMiner
from training.trainer import StepLosses, Trainer, in_row_order, steps_within


def config(tmp_path, tiny_model_dir, **kw) -> TrainConfig:
    base = dict(
        output_dir=str(tmp_path / "run"),
        model=ModelConfig(base_model=str(tiny_model_dir), dropout=0.0),
        num_negatives=3,
        batch_size=4,
        max_steps=4,
        eval_every=2,
        valid_size=8,
        valid_candidates=4,
        lr=3e-3,
        device="cpu",
        log_every=1,
    )
    base.update(kw)
    return TrainConfig(**base)


def pool_of(pairs):
    return sorted({p.response for p in pairs})


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["core", "mutual"])
def test_cooperative_training_improves_both_models(tmp_path, tiny_model_dir, toy_pairs, mode):
    cfg = config(
        tmp_path, tiny_model_dir, mode=mode, batch_size=8, max_steps=40, eval_every=20, valid_size=16
    )
    summary = Trainer(cfg, toy_pairs, toy_pairs[:16], pool_of(toy_pairs)).fit()
    start = records(tmp_path / "run")[0]["valid"]
    assert summary["best_valid_hits@1"]["bi"] >= start["bi"]["hits@1"] + 40
    assert summary["best_valid_hits@1"]["cross"] > start["cross"]["hits@1"]
    for name in ("bi", "cross"):
        assert load_checkpoint(tmp_path / "run" / name, expect=name)
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 1000
    assert summary["examples_seen"] == 40 * 8


@pytest.mark.parametrize("in_batch", [False, True])
def test_core_gradients_come_only_from_each_models_own_loss(tmp_path, tiny_model_dir, toy_pairs, in_batch):
    """The retriever's KL target is the reranker's distribution and vice versa; neither KL may send
    gradient into the model that produced its target."""
    cfg = config(tmp_path, tiny_model_dir, mode="core", in_batch=in_batch, gamma_r=1.0, gamma_g=3.0, tau=3.0)
    trainer = Trainer(cfg, toy_pairs, [], pool_of(toy_pairs))
    trainer.bi.eval(), trainer.cross.eval()  # no dropout: the two computations below must agree exactly
    pairs, rng = trainer._global_batch(0, 0)
    mb = trainer._micro_batch(pairs, trainer._candidate_lists(pairs, rng))
    trainer._micro_step(mb, 1.0, StepLosses())
    got_bi = [p.grad.clone() for p in trainer.bi.parameters()]
    got_cross = [p.grad.clone() for p in trainer.cross.parameters()]

    ctx, resp = trainer.bi([c for _, c in mb.contexts], [c for _, c in mb.responses])  # the CE by hand
    ctx = in_row_order(ctx, mb.contexts)
    resp = in_row_order(resp, mb.responses).view(4, 4, -1)  # [B, N, D]
    R = torch.einsum("bd,bnd->bn", ctx, resp)
    assert torch.allclose(R, trainer._bi_scores(mb)[0], atol=1e-6)
    if in_batch:
        R_all, R_targets = ctx @ resp.reshape(16, -1).T, torch.arange(4) * 4  # every list's candidates
    else:
        R_all, R_targets = R, None
    G = trainer._cross_scores(trainer.cross, mb.cross, mb.lists)
    bi_loss = listwise_ce(R_all, R_targets) + 1.0 * kl_to_target(G.detach(), R, 3.0)
    cross_loss = listwise_ce(G) + 3.0 * kl_to_target(R.detach(), G, 3.0)
    want_bi = torch.autograd.grad(bi_loss, list(trainer.bi.parameters()))
    want_cross = torch.autograd.grad(cross_loss, list(trainer.cross.parameters()))
    for got, want in zip(got_bi + got_cross, list(want_bi) + list(want_cross), strict=True):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def test_independent_and_distill_modes(tmp_path, tiny_model_dir, toy_pairs):
    indep = config(tmp_path, tiny_model_dir, mode="independent", output_dir=str(tmp_path / "indep"))
    Trainer(indep, toy_pairs, toy_pairs[:8], pool_of(toy_pairs)).fit()
    distill = config(
        tmp_path,
        tiny_model_dir,
        mode="distill",
        teacher=str(tmp_path / "indep" / "cross"),
        output_dir=str(tmp_path / "distill"),
        hard_negatives=2,
        hard_refresh=2,
        hard_top=5,
    )
    trainer = Trainer(distill, toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    assert trainer.cross is None and not any(p.requires_grad for p in trainer.teacher.parameters())
    before = [p.clone() for p in trainer.teacher.parameters()]
    summary = trainer.fit()
    assert set(summary["best_valid_hits@1"]) == {"bi"}
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.teacher.parameters(), strict=True))
    assert "bi_kl" in records(tmp_path / "distill")[1]


def test_a_reranker_alone_learns_from_negatives_a_frozen_retriever_mines(tmp_path, tiny_model_dir, toy_pairs):
    """``--models cross --hard-negatives k --init-bi R``: R, frozen, mines the candidates the reranker will
    rerank behind it; without R the run is refused."""
    Trainer(
        config(tmp_path, tiny_model_dir, mode="independent", models="bi"), toy_pairs, [], pool_of(toy_pairs)
    ).fit()
    mined = dict(mode="independent", models="cross", hard_negatives=2, hard_refresh=100, hard_top=3)
    with pytest.raises(ValueError, match="name the one that mines them with --init-bi"):
        Trainer(config(tmp_path, tiny_model_dir, **mined), toy_pairs, [], pool_of(toy_pairs))
    cfg = config(
        tmp_path,
        tiny_model_dir,
        init_bi=str(tmp_path / "run" / "bi"),
        output_dir=str(tmp_path / "x"),
        **mined,
    )
    trainer = Trainer(cfg, toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    retriever = trainer.mining_bi
    assert trainer.bi is None and not any(p.requires_grad for p in retriever.parameters())
    before = [p.clone() for p in retriever.parameters()]
    assert trainer._refresh_miner()  # the pool embedded by the frozen retriever
    assert torch.allclose(trainer.miner.embeddings, retriever.embed_responses(trainer.miner.pool), atol=1e-6)
    assert all(len(c) == 4 for c in trainer._candidate_lists(toy_pairs[:4], np.random.default_rng(0)))
    assert set(trainer.fit()["best_valid_hits@1"]) == {"cross"}
    assert all(torch.equal(a, b) for a, b in zip(before, retriever.parameters(), strict=True))


def test_a_residual_reranker_learns_the_frozen_retrievers_mistakes(
    tmp_path, tiny_model_dir, toy_pairs, monkeypatch
):
    """``--cross-residual``: a list's scores are the frozen retriever's plus the reranker's; the new head
    starts at zero (the pair ranks as the retriever does), the loss is the CE of the sum, validation
    chooses by the sum, and the checkpoint names the retriever it corrects."""
    Trainer(
        config(tmp_path, tiny_model_dir, mode="independent", models="bi"), toy_pairs, [], pool_of(toy_pairs)
    ).fit()
    retriever_dir = tmp_path / "run" / "bi"
    for wrong in (dict(models="both"), dict(mode="core"), dict(init_bi=None)):
        with pytest.raises(ValueError, match="--cross-residual"):
            config(tmp_path, tiny_model_dir, **{**dict(mode="independent", models="cross",
                   init_bi=str(retriever_dir), cross_residual=True), **wrong})  # fmt: skip
    cfg = config(
        tmp_path,
        tiny_model_dir,
        mode="independent",
        models="cross",
        init_bi=str(retriever_dir),
        cross_residual=True,
        output_dir=str(tmp_path / "res"),
    )
    trainer = Trainer(cfg, toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    assert trainer.bi is None and not any(p.requires_grad for p in trainer.frozen_bi.parameters())
    trainer.cross.eval()
    pairs, rng = trainer._global_batch(0, 0)
    mb = trainer._micro_batch(pairs, trainer._candidate_lists(pairs, rng))
    G = trainer._cross_scores(trainer.cross, mb.cross, mb.lists)  # [B, N]
    assert torch.equal(G, torch.zeros_like(G))  # the head's last layer starts at zero
    trainer._micro_step(mb, 1.0, StepLosses())
    got = [p.grad.clone() for p in trainer.cross.parameters()]
    R = trainer._bi_scores(mb, trainer.frozen_bi)[0].detach()
    params = list(trainer.cross.parameters())
    want = torch.autograd.grad(listwise_ce(G + R), params, allow_unused=True, retain_graph=True)
    plain = torch.autograd.grad(listwise_ce(G), params, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, torch.zeros_like(g) if w is None else w, atol=1e-6)
    assert not torch.allclose(got[-2], plain[-2])  # the head's last weight: the retriever's scores count
    trainer.cross.train()
    for p in trainer.cross.parameters():
        p.grad = None

    # Started from a trained reranker (--init-cross), its head is kept: the sum starts as the two models'
    # sum fusion, not as the retriever alone.
    alone = replace(cfg, init_bi=None, cross_residual=False, output_dir=str(tmp_path / "alone"))
    Trainer(alone, toy_pairs, toy_pairs[:8], pool_of(toy_pairs)).fit()
    trained = load_checkpoint(tmp_path / "alone" / "cross", expect="cross").eval()
    warm = Trainer(
        replace(cfg, init_cross=str(tmp_path / "alone" / "cross"), output_dir=str(tmp_path / "warm")),
        toy_pairs,
        toy_pairs[:8],
        pool_of(toy_pairs),
    )
    warm.cross.eval()
    G = warm._cross_scores(warm.cross, mb.cross, mb.lists)  # [B, N]
    assert not torch.equal(G, torch.zeros_like(G))
    assert torch.allclose(G, trainer._cross_scores(trained, mb.cross, mb.lists), atol=1e-6)

    summary = trainer.fit()
    first = records(tmp_path / "res")[0]["valid"]
    assert first["sum"] == first["bi"]  # at step 0 the reranker ranks as its retriever
    assert summary["selected_by"] == {"cross": "sum"}
    meta = json.loads((tmp_path / "res" / "cross" / "checkpoint.json").read_text())
    assert meta["extra"]["residual_to"] == load_checkpoint(retriever_dir, expect="bi").content_hash

    # With a validation pool, the reranker reorders the frozen retriever's recall there (made once) and
    # is kept by the sum's hits@1 on it: its candidates as served behind that retriever.
    recalls = []
    monkeypatch.setattr(trainer_module, "recall_pool", lambda *a: recalls.append(a) or recall_pool(*a))
    cfg = replace(cfg, valid_pool=10, output_dir=str(tmp_path / "res-pool"))
    summary = Trainer(cfg, toy_pairs, toy_pairs[:8], pool_of(toy_pairs)).fit()
    assert summary["selected_by"] == {"cross": "sum_pool"} and len(recalls) == 1
    logged = [r["valid"] for r in records(tmp_path / "res-pool") if "valid" in r]
    assert len(logged) == 3 and logged[0]["sum_pool"] == logged[0]["bi_pool"]  # step 0: the retriever's order
    assert {"bi_pool", "cross_pool", "sum_pool", "sum"} <= set(logged[0])
    meta = json.loads((tmp_path / "res-pool" / "cross" / "checkpoint.json").read_text())
    assert meta["extra"]["valid"]["sum_pool"]["hits@1"] == summary["best_valid_hits@1"]["cross"]


def trained_reranker(tmp_path, tiny_model_dir, toy_pairs) -> str:
    """A 2-layer reranker trained alone for a few steps (a teacher): its checkpoint's path."""
    indep = config(
        tmp_path, tiny_model_dir, mode="independent", models="cross", output_dir=str(tmp_path / "t")
    )
    Trainer(indep, toy_pairs, toy_pairs[:8], pool_of(toy_pairs)).fit()
    return str(tmp_path / "t" / "cross")


def test_distill_into_a_smaller_cross_encoder(tmp_path, tiny_model_dir, toy_pairs):
    """``--models cross``: a 1-layer reranker learns CE + gamma_G * KL(teacher || student); the teacher
    (the 2-layer reranker trained alone) stays frozen."""
    teacher = trained_reranker(tmp_path, tiny_model_dir, toy_pairs)
    small = ModelConfig(base_model=str(tiny_model_dir), dropout=0.0, num_layers=1)
    cfg = config(tmp_path, tiny_model_dir, mode="distill", models="cross", teacher=teacher, model=small)
    trainer = Trainer(cfg, toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    assert trainer.bi is None and len(trainer.cross.backbone.encoder.layer) == 1
    assert len(trainer.teacher.backbone.encoder.layer) == 2
    trainer.cross.eval()
    pairs, rng = trainer._global_batch(0, 0)
    mb = trainer._micro_batch(pairs, trainer._candidate_lists(pairs, rng))
    trainer._micro_step(mb, 1.0, StepLosses())
    got = [p.grad.clone() for p in trainer.cross.parameters()]
    K = trainer._cross_scores(trainer.teacher, mb.teacher, mb.lists)
    G = trainer._cross_scores(trainer.cross, mb.cross, mb.lists)
    loss = listwise_ce(G) + cfg.gamma_g * kl_to_target(K, G, cfg.tau)
    want = torch.autograd.grad(loss, list(trainer.cross.parameters()))
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert all(p.grad is None for p in trainer.teacher.parameters())
    trainer.cross.zero_grad(set_to_none=True)
    summary = trainer.fit()
    assert set(summary["best_valid_hits@1"]) == {"cross"} and "cross_kl" in records(tmp_path / "run")[1]
    assert load_checkpoint(tmp_path / "run" / "cross", expect="cross").config.num_layers == 1


def test_a_student_starts_from_its_teachers_first_layers_and_head(tmp_path, tiny_model_dir, toy_pairs):
    """``--init-cross T --num-layers k`` below T's depth: T's embeddings, first k layers and head, reading
    pairs at the run's token budgets; T's own checkpoint is untouched, and adapters are refused."""
    path = trained_reranker(tmp_path, tiny_model_dir, toy_pairs)
    teacher = load_checkpoint(path, expect="cross")
    budgets = dict(num_layers=1, max_context_tokens=20, max_response_tokens=8)
    small = ModelConfig(base_model=str(tiny_model_dir), dropout=0.0, **budgets)
    cfg = config(
        tmp_path, tiny_model_dir, mode="distill", models="cross", teacher=path, init_cross=path, model=small
    )
    student = Trainer(cfg, toy_pairs, toy_pairs[:8], pool_of(toy_pairs)).cross
    assert len(student.backbone.encoder.layer) == 1 and len(teacher.backbone.encoder.layer) == 2
    assert {k: getattr(student.config, k) for k in budgets} == budgets
    want = {k: v for k, v in teacher.state_dict().items() if "encoder.layer.1." not in k}
    got = student.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].to(got[k].device)) for k in want)
    with pytest.raises(ValueError, match="--cross-lora-rank 0"):
        Trainer(replace(cfg, lora_rank=4), toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    too_deep = replace(small, num_layers=3)
    with pytest.raises(ValueError, match=r"--num-layers 3: --init-cross .* has only 2 layers"):
        Trainer(replace(cfg, model=too_deep), toy_pairs, toy_pairs[:8], pool_of(toy_pairs))


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_resume_continues_exactly_where_an_interrupted_run_stopped(
    tmp_path, tiny_model_dir, toy_pairs, monkeypatch, lora_rank
):
    # The tiny model keeps BERT's dropout here, so this also checks that the RNG state is restored.
    cfg = dict(
        mode="core",
        max_steps=6,
        eval_every=3,
        lora_rank=lora_rank,
        model=ModelConfig(base_model=str(tiny_model_dir)),
    )
    straight = Trainer(
        config(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "a"), **cfg),
        toy_pairs,
        toy_pairs[:8],
        pool_of(toy_pairs),
    )
    straight.fit()

    interrupted = Trainer(
        config(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "b"), **cfg),
        toy_pairs,
        toy_pairs[:8],
        pool_of(toy_pairs),
    )
    real_step = interrupted.train_step

    def crash_after_three(epoch, index):
        if interrupted.step == 4:
            raise KeyboardInterrupt
        return real_step(epoch, index)

    monkeypatch.setattr(interrupted, "train_step", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit()
    resumed = Trainer(
        config(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "b"), **cfg),
        toy_pairs,
        toy_pairs[:8],
        pool_of(toy_pairs),
    )
    summary = resumed.fit()
    assert summary["steps"] == 6 and summary["examples_seen"] == 6 * 4
    for a, b in zip(straight.bi.parameters(), resumed.bi.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    for a, b in zip(straight.cross.parameters(), resumed.cross.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_early_stopping_after_patience_evaluations_without_a_new_best(tmp_path, tiny_model_dir, toy_pairs):
    # lr 1e-30: every update is below float32 resolution, so validation never improves
    cfg = config(tmp_path, tiny_model_dir, mode="core", lr=1e-30, max_steps=20, eval_every=2, patience=2)
    summary = Trainer(cfg, toy_pairs, toy_pairs[:8], pool_of(toy_pairs)).fit()
    assert summary["stopped_early"] and summary["steps"] == 4


def test_a_validation_pool_ranks_golds_over_many_responses_and_chooses_the_retriever(
    tmp_path, tiny_model_dir, toy_pairs
):
    pool = [*pool_of(toy_pairs), "ok then", "see you later", "that is funny", "what do you mean ?"]
    cfg = config(tmp_path, tiny_model_dir, mode="core", valid_pool=10)  # the 8 golds + 2 of the 4 others
    trainer = Trainer(cfg, toy_pairs, toy_pairs[:8], pool)
    assert {normalize(p.response) for p in trainer.valid_pairs} < {normalize(t) for t in trainer.valid_pool}
    assert len(trainer.valid_pool) == 10
    assert trainer.fit()["selected_by"] == {"bi": "bi_pool", "cross": "cross_pool"}
    for record in (r for r in records(tmp_path / "run") if "valid" in r):
        assert record["valid"]["bi_pool"]["n"] == 8 and "bi" in record["valid"]  # both kinds logged
    # each is chosen by the pool's hits@1 in its own order there, not by its 1-of-N lists'
    trainer.best = {}
    lists, pool = {"hits@1": 90.0}, {"hits@1": 5.0}
    trainer._after_eval({"bi": lists, "bi_pool": pool, "cross": lists, "cross_pool": {"hits@1": 7.0}})
    assert trainer.best == {"bi": 5.0, "cross": 7.0}
    lists, pool = {"hits@1": 10.0}, {"hits@1": 6.0}
    trainer._after_eval({"bi": lists, "bi_pool": pool, "cross": lists, "cross_pool": {"hits@1": 6.5}})
    assert trainer.best == {"bi": 6.0, "cross": 7.0}
    saved = json.loads((tmp_path / "run" / "bi" / "checkpoint.json").read_text())["extra"]["valid"]
    assert saved["bi_pool"]["hits@1"] == 6.0


def test_a_validation_pool_that_cannot_rank_is_refused_or_ignored(
    tmp_path, tiny_model_dir, toy_pairs, caplog
):
    with pytest.raises(ValueError, match=r"valid_pool \(--valid-pool\) must exceed the \d+ distinct"):
        Trainer(config(tmp_path, tiny_model_dir, valid_pool=3), toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    with pytest.raises(ValueError, match=r"valid_pool \(--valid-pool\) must be >= 0"):
        TrainConfig(valid_pool=-1)
    cfg = config(tmp_path, tiny_model_dir, mode="independent", models="cross", valid_pool=100)
    trainer = Trainer(cfg, toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    assert trainer.valid_pool == [] and trainer.frozen_bi is None  # a reranker alone, no retriever to rank
    assert "--valid-pool ignored" in caplog.text


def test_steps_within_counts_the_validations_and_keeps_one_for_the_end():
    # from step 2, 1 s a step, 5 s a validation after steps 5, 10, ... and after the last one
    assert steps_within(53, 2, 1.0, 5.0, 5) == 23  # to step 25: 23 s + 5 validations = 48 s; 26 would be 54
    assert steps_within(48, 2, 1.0, 5.0, 5) == 23 and steps_within(47.9, 2, 1.0, 5.0, 5) == 22
    assert steps_within(4, 2, 1.0, 5.0, 5) == 0  # not even the last validation fits
    assert steps_within(10, 0, 0.5, 0.0, None) == 20  # no validation: the steps alone
    assert steps_within(-3, 0, 0.5, 1.0, 4) == 0


def test_a_time_budget_plans_the_run_to_end_with_its_last_validation_inside_it(
    tmp_path, tiny_model_dir, toy_pairs
):
    # A fake clock makes the arithmetic exact: a step takes 1 s, a validation 5 s, the budget is 60 s.
    cfg = config(tmp_path, tiny_model_dir, mode="core", max_steps=1000, eval_every=5, max_minutes=1.0)
    trainer = Trainer(cfg, toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    now = [0.0]
    trainer.clock = lambda: now[0]
    real_step, real_validate = trainer.train_step, trainer.validate

    def step(*args):
        now[0] += 1.0
        return real_step(*args)

    def validate():
        now[0] += 5.0
        return real_validate()

    trainer.train_step, trainer.validate = step, validate
    summary = trainer.fit()
    # step-0 validation 5 s, then 5 x (5 steps + validation) = 55 s; a 26th step and its validation: 61 s
    assert summary["steps"] == 25 and summary["planned_steps"] == 1000
    assert summary["elapsed_seconds"] == 55.0 and not summary["stopped_early"]
    last = records(tmp_path / "run")[-1]
    assert last["step"] == 25 and last["valid"]  # the run ends with its validation
    assert trainer.schedulers["bi"].get_last_lr() == [0.0]  # the schedule decayed to the planned end
    assert (tmp_path / "run" / "bi" / "checkpoint.json").is_file()


def test_a_lora_run_continues_an_adapter_checkpoints_own_adapters(tmp_path, tiny_model_dir, toy_pairs):
    """--init-bi with --lora-rank: the checkpoint's adapters train on (the run starts from exactly its
    weights and ends as another small adapter checkpoint); a plain checkpoint or another rank is refused."""
    first = config(tmp_path, tiny_model_dir, mode="independent", models="bi", lora_rank=2, max_steps=6,
                   valid_size=0, output_dir=str(tmp_path / "first"))  # fmt: skip
    Trainer(first, toy_pairs, toy_pairs[:8], pool_of(toy_pairs)).fit()  # no validation: the last weights
    saved = trainable_state(load_checkpoint(tmp_path / "first" / "bi", merge=False))
    assert any(name.endswith("lora_B") and w.abs().sum() > 0 for name, w in saved.items())
    more = replace(first, output_dir=str(tmp_path / "more"), init_bi=str(tmp_path / "first" / "bi"))
    trainer = Trainer(more, toy_pairs, toy_pairs[:8], pool_of(toy_pairs))
    start = trainable_state(trainer.bi)
    assert start.keys() == saved.keys() and all(torch.equal(start[k], saved[k]) for k in saved)
    trainer.fit()
    meta = json.loads((tmp_path / "more" / "bi" / "checkpoint.json").read_text())
    assert meta["adapter"]["rank"] == 2 and meta["extra"]["train_config"]["init_bi"] == more.init_bi
    plain = replace(first, output_dir=str(tmp_path / "plain"), lora_rank=0, max_steps=1)
    Trainer(plain, toy_pairs, toy_pairs[:8], pool_of(toy_pairs)).fit()
    for init, rank, found in (("first", 4, "rank-2 adapters"), ("plain", 2, "plain weights")):
        with pytest.raises(ValueError, match=f"--lora-rank {rank} continues .* holds {found}"):
            bad = replace(more, init_bi=str(tmp_path / init / "bi"), lora_rank=rank)
            Trainer(bad, toy_pairs, toy_pairs[:8], pool_of(toy_pairs))


def test_config_errors():
    with pytest.raises(ValueError, match="needs --teacher"):
        TrainConfig(mode="distill")
    with pytest.raises(ValueError, match="cannot exceed"):
        TrainConfig(num_negatives=2, hard_negatives=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        TrainConfig(mode="adversarial")
    with pytest.raises(ValueError, match=r"warmup_ratio \(--warmup-ratio\) must be in \[0, 1\)"):
        TrainConfig(warmup_ratio=1.0)
    with pytest.raises(ValueError, match="drop --max-batch-tokens"):
        TrainConfig(packed=True, max_batch_tokens=4096)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr": float("inf")}, r"lr \(--lr\) must be finite and > 0, got inf"),
        ({"tau": float("nan")}, r"tau \(--tau\) must be finite and > 0, got nan"),
        ({"max_minutes": float("inf")}, r"max_minutes \(--max-minutes\) must be finite and > 0"),
        ({"seed": -1}, r"seed \(--seed\) must be >= 0, got -1"),
        ({"model": {"score_scale": float("nan")}}, r"score_scale \(--score-scale\) must be finite and > 0"),
        ({"model": {"dropout": 1.0}}, r"dropout \(--dropout\) must be in \[0, 1\), got 1.0"),
    ],
)
def test_nonsense_numbers_are_refused_naming_the_flag(settings, message):
    """Infinite or NaN rates and temperatures once trained to NaN weights; a negative seed failed deep in
    numpy with no flag named."""
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


def test_negative_sampler_never_returns_the_positive():
    sampler = NegativeSampler(["Yes", "yes ", "no", "maybe", "sure"])
    rng = np.random.default_rng(0)
    for _ in range(50):
        negatives = sampler.sample("YES", 3, rng)
        assert "yes" not in {normalize(n) for n in negatives}
        assert len({normalize(n) for n in negatives}) == 3


def test_negative_sampler_on_a_small_pool_never_repeats_and_refuses_more_than_it_has():
    """25 distinct responses, many copies each (a support bot's canned replies): a list of 24 negatives
    holds every other response once and never the gold; 25 cannot be drawn."""
    pool = [f"answer {i % 25}" for i in range(350)]
    sampler = NegativeSampler(pool)
    assert sampler.capacity == 24
    rng = np.random.default_rng(0)
    for gold in ("answer 3", "ANSWER 3 "):
        keys = {normalize(n) for n in sampler.sample(gold, 24, rng)}
        assert len(keys) == 24 and "answer 3" not in keys
    assert len({normalize(n) for n in sampler.sample("not in the pool", 25, rng)}) == 25
    with pytest.raises(ValueError, match="only 24 distinct"):
        sampler.sample("answer 3", 25, rng)


def test_small_data_caps_negatives_and_protocol_a_lists_with_a_message(tiny_model_dir, tmp_path, caplog):
    """Fewer distinct responses than --num-negatives / --valid-candidates: lists as long as the data
    allows (said in the log and recorded in train_config.json), none holding a copy of its gold."""
    from coreply.corpus import Pair
    from evaluation.protocols import protocol_a_lists

    pairs = [Pair(("question", f"about {i % 5}"), f"reply {i % 5}", str(i)) for i in range(40)]
    with caplog.at_level("WARNING"):
        lists = protocol_a_lists(pairs, [p.response for p in pairs], size=100)
    assert "lists of 5 instead" in caplog.text
    assert all(len(c) == 5 and len({normalize(t) for t in c}) == 5 for c in lists)
    config = TrainConfig(
        output_dir=str(tmp_path / "run"), model=ModelConfig(base_model=str(tiny_model_dir)), num_negatives=32,
        max_steps=2, eval_every=2, valid_size=8, valid_candidates=100, device="cpu", prefetch=False,
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        trainer = Trainer(config, pairs, pairs[:8], [p.response for p in pairs])
    assert "--num-negatives 32, but the training pool has 5 distinct responses: 4 negatives" in caplog.text
    assert trainer.cfg.num_negatives == 4
    lists = trainer._candidate_lists(pairs[:8], np.random.default_rng(0))
    assert all(len(c) == 5 and len({normalize(t) for t in c}) == 5 for c in lists)
    trainer.fit()
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["num_negatives"] == 4


def test_hard_negative_miner_takes_the_retrievers_top_candidates_except_the_gold(tiny_model_dir, toy_pairs):
    from coreply.models import BiEncoder

    bi = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir))).eval()
    pool = pool_of(toy_pairs) + [f"filler {i}" for i in range(20)]
    miner = HardNegativeMiner(pool, count=2, refresh_every=5, sample_size=len(pool), top_k=3, seed=0)
    miner.maybe_refresh(bi, step=0)
    mined = miner.mine(bi, toy_pairs[:6], np.random.default_rng(0))
    scores = bi.embed_contexts([p.context for p in toy_pairs[:6]]) @ miner.embeddings.T
    for pair, negatives, row in zip(toy_pairs[:6], mined, scores, strict=True):
        top = {miner.pool[i] for i in torch.topk(row, 3).indices.tolist()}
        assert len(negatives) == 2 and set(negatives) <= top
        assert normalize(pair.response) not in {normalize(n) for n in negatives}
    first = miner.embeddings
    miner.maybe_refresh(bi, step=3)
    assert miner.embeddings is first  # not yet due
    miner.maybe_refresh(bi, step=5)
    assert miner.embeddings is not first
    second = miner.embeddings  # a frozen retriever's pool is embedded once; its queries are still searched
    bi.requires_grad_(False)  # as a reranker-only run's --init-bi retriever
    assert miner.maybe_refresh(bi, step=10, ahead=toy_pairs[:2], kinds={"context": 2})
    assert miner.embeddings is second and miner.refreshed_at == 10 and len(miner._rows) == 2


def test_length_sorted_chunks_score_like_one_padded_batch(tmp_path, tiny_model_dir, toy_pairs):
    one = Trainer(
        config(tmp_path, tiny_model_dir, mode="core", packed=False), toy_pairs, [], pool_of(toy_pairs)
    )
    chunked = Trainer(
        config(tmp_path, tiny_model_dir, mode="core", max_batch_tokens=60), toy_pairs, [], pool_of(toy_pairs)
    )
    chunked.bi.load_state_dict(one.bi.state_dict()), chunked.cross.load_state_dict(one.cross.state_dict())
    for m in (one.bi, one.cross, chunked.bi, chunked.cross):
        m.eval()
    pairs, rng = one._global_batch(0, 0)
    lists = one._candidate_lists(pairs, rng)
    a, b = one._micro_batch(pairs, lists), chunked._micro_batch(pairs, lists)
    assert len(a.cross) == len(a.responses) == len(a.contexts) == 1
    assert len(b.cross) > 1 and len(b.responses) > 1 and len(b.contexts) > 1
    for name in ("bi", "cross"):
        assert b.counts[f"{name}_tokens"] == a.counts[f"{name}_tokens"]
        assert b.counts[f"{name}_padded"] < a.counts[f"{name}_padded"]
    with torch.no_grad():
        want = one._cross_scores(one.cross, a.cross, a.lists)
        got = chunked._cross_scores(chunked.cross, b.cross, b.lists)
        assert got.shape == (4, 4) and torch.allclose(got, want, atol=1e-5)
        for want_r, got_r in zip(one._bi_scores(a), chunked._bi_scores(b), strict=True):
            assert got_r is None or torch.allclose(got_r, want_r, atol=1e-5)


def test_packed_inputs_train_like_padded_ones_and_compute_no_padding(tmp_path, tiny_model_dir, toy_pairs):
    runs = []
    for packed in (False, True):
        cfg = config(
            tmp_path, tiny_model_dir, mode="core", packed=packed, output_dir=str(tmp_path / str(packed))
        )
        trainer = Trainer(cfg, toy_pairs, [], pool_of(toy_pairs))
        trainer.bi.eval(), trainer.cross.eval()  # no dropout: the same losses to the rounding
        pairs, rng = trainer._global_batch(0, 0)
        counts = trainer._micro_batch(pairs, trainer._candidate_lists(pairs, rng)).counts
        assert (counts["cross_padded"] == counts["cross_tokens"]) == packed
        assert (counts["bi_padded"] == counts["bi_tokens"]) == packed
        # the losses of steps 2 and 3 are those of the updated models (their parameters are not compared:
        # Adam turns the rounding noise of gradients that are zero in exact arithmetic, such as the head's
        # bias under a list-wise softmax, into steps of the learning rate's size)
        runs.append([trainer.reduce_losses(trainer.train_step(0, i)) for i in range(3)])
    for want, got in zip(*runs, strict=True):
        assert want.keys() == got.keys() and all(abs(want[k] - got[k]) < 1e-4 for k in want)


def test_a_cpu_trains_packed_unless_told_otherwise(tmp_path, tiny_model_dir, toy_pairs):
    """``packed`` unset: packed on a CPU, where it is the padded model at less cost; padded beside
    ``--max-batch-tokens`` or when asked (CUDA too, until a lease has measured that it pays there)."""

    def packs(**kw) -> bool:
        trainer = Trainer(
            config(tmp_path, tiny_model_dir, mode="core", **kw), toy_pairs, [], pool_of(toy_pairs)
        )
        pairs, rng = trainer._global_batch(0, 0)
        counts = trainer._micro_batch(pairs, trainer._candidate_lists(pairs, rng)).counts
        assert (counts["cross_padded"] == counts["cross_tokens"]) == trainer.packed
        return trainer.packed

    assert TrainConfig().packed is None
    assert (packs(), packs(packed=False), packs(max_batch_tokens=60), packs(packed=True)) == (
        True,
        False,
        False,
        True,
    )


def test_restatement_negatives_come_from_the_context_and_the_last_turns_neighbours(
    tmp_path, tiny_model_dir, toy_pairs
):
    cfg = config(
        tmp_path, tiny_model_dir, mode="core", num_negatives=6, own_turn_negatives=2, paraphrase_negatives=2
    )
    pool = [*pool_of(toy_pairs), *(p.context[-1] for p in toy_pairs), *(f"filler {i}" for i in range(20))]
    trainer = Trainer(cfg, toy_pairs, [], sorted(set(pool)))
    trainer.bi.eval()  # no dropout, so the neighbours below are the miner's
    trainer.miner.maybe_refresh(trainer.bi, 0)
    pairs, rng = trainer._global_batch(0, 0)
    lists = trainer._candidate_lists(pairs, rng)
    for pair, cands in zip(pairs, lists, strict=True):
        assert cands[0] == pair.response and len(cands) == 7
        assert len({normalize(t) for t in cands}) == 7  # no duplicates, never the gold twice
        assert cands[1:3] == [pair.context[-1], pair.context[-2]]  # own turns, latest first
        last = trainer.bi.embed_responses([pair.context[-1]])  # [1, D]
        nearest = torch.topk((last @ trainer.miner.embeddings.T)[0], 2 * 2 + 1).indices.tolist()
        assert set(cands[3:5]) <= {trainer.miner.pool[i] for i in nearest}
    # without own-turn negatives the miner still never offers a copy of a context turn (an echo, which
    # the service filters anyway, and the nearest "paraphrase" of the last turn is itself)
    trainer.cfg.own_turn_negatives = 0
    for pair, cands in zip(pairs, trainer._candidate_lists(pairs, rng), strict=True):
        assert not {normalize(t) for t in cands[1:]} & {normalize(t) for t in pair.context}


def test_a_paraphrase_floor_keeps_only_neighbours_that_close_and_fills_the_list_at_random(
    tmp_path, tiny_model_dir, toy_pairs
):
    pool = sorted({*pool_of(toy_pairs), *(f"filler {i}" for i in range(20))})
    cfg = config(tmp_path, tiny_model_dir, mode="core", num_negatives=6, paraphrase_negatives=3)
    pairs = toy_pairs[:8]

    def mined_and_lists(floor: float) -> tuple[list[list[str]], list[list[str]]]:
        trainer = Trainer(replace(cfg, paraphrase_floor=floor), toy_pairs, [], pool)
        trainer.bi.eval()
        trainer.miner.maybe_refresh(trainer.bi, 0)
        mined = trainer.miner.mine(trainer.bi, pairs, np.random.default_rng(0), 3, "last_turn")
        return mined, trainer._candidate_lists(pairs, np.random.default_rng(0))

    trainer = Trainer(cfg, toy_pairs, [], pool)  # the same initial weights: the same cosines
    last = trainer.bi.eval().embed_responses([p.context[-1] for p in pairs])  # [8, D]
    cos = (
        torch.nn.functional.normalize(last, dim=-1)
        @ torch.nn.functional.normalize(trainer.bi.embed_responses(pool), dim=-1).T
    )  # [8, P]
    cosine = [dict(zip(pool, row.tolist(), strict=True)) for row in cos]
    nearest, _ = mined_and_lists(0.0)
    floor = float(np.median([cosine[i][t] for i, ts in enumerate(nearest) for t in ts]))
    for value in (floor, 0.9999):
        mined, lists = mined_and_lists(value)
        assert all(cosine[i][t] >= value for i, ts in enumerate(mined) for t in ts)
        assert sum(map(len, mined)) < sum(map(len, nearest))  # some were below it
        assert all(len(cands) == 7 for cands in lists)  # random negatives make up the rest
    assert any(mined_and_lists(floor)[0]) and not any(mined)
    for wrong in (dict(paraphrase_floor=1.0), dict(paraphrase_floor=0.5, paraphrase_negatives=0)):
        with pytest.raises(ValueError, match="paraphrase_floor"):
            replace(cfg, **wrong)


def test_first_lists_and_list_scores_show_what_a_run_trains_on(tmp_path, tiny_model_dir, toy_pairs):
    """The inspection API (bench/paraphrase_negatives.py): a fresh run's first lists, mined as the run
    mines them, and each model's scores of them as training computes them."""
    cfg = config(tmp_path, tiny_model_dir, mode="core", num_negatives=4, paraphrase_negatives=1)
    trainer = Trainer(cfg, toy_pairs, [], pool_of(toy_pairs))
    seen = list(trainer.first_lists(2))
    run = Trainer(cfg, toy_pairs, [], pool_of(toy_pairs))
    assert run._refresh_miner()
    assert [mb.lists for mb in run._prepare(0, 0)] == [seen[0][1]]  # what step 0 trains on
    assert len(seen) == 2 and seen[1][0] != seen[0][0]
    pairs, lists = seen[0]
    scores = trainer.list_scores(pairs, lists)
    assert set(scores) == {"bi", "cross"} and scores["bi"].shape == scores["cross"].shape == (4, 5)
    for i, (pair, cands) in enumerate(zip(pairs, lists, strict=True)):
        assert cands[0] == pair.response and len(set(cands)) == 5
        with torch.no_grad():
            bi = trainer.bi.embed_contexts([pair.context]) @ trainer.bi.embed_responses(cands).T  # [1, 5]
            cross = trainer.cross.score_pairs([pair.context] * 5, cands)  # [5]
        assert torch.allclose(scores["bi"][i], bi[0], atol=1e-5)
        assert torch.allclose(scores["cross"][i], cross, atol=1e-5)


def test_negative_counts_are_checked():
    with pytest.raises(ValueError, match="cannot exceed num_negatives"):
        TrainConfig(num_negatives=4, own_turn_negatives=2, paraphrase_negatives=2, hard_negatives=1)
    with pytest.raises(ValueError, match="must be >= 0"):
        TrainConfig(own_turn_negatives=-1)


@pytest.mark.parametrize("mined", [0, 1])
def test_prefetching_the_next_step_trains_exactly_like_building_it_in_turn(
    tmp_path, tiny_model_dir, toy_pairs, mined
):
    # with paraphrase negatives too: the miner searches only at its refreshes (steps 0, 2, 4), on the
    # training thread, and a step prefetched before a refresh is drawn again after it
    runs = []
    for prefetch in (True, False):
        cfg = config(
            tmp_path,
            tiny_model_dir,
            mode="core",
            prefetch=prefetch,
            output_dir=str(tmp_path / str(prefetch)),
            max_steps=5,
            paraphrase_negatives=mined,
            hard_refresh=2,
        )
        trainer = Trainer(cfg, toy_pairs, [], pool_of(toy_pairs))
        trainer.bi.eval(), trainer.cross.eval()  # no dropout: both runs are deterministic
        assert (trainer._prefetcher is not None) == prefetch
        searches = []
        if mined:
            real_search = trainer.miner._search

            def search(*args, real_search=real_search, searches=searches, trainer=trainer):
                searches.append((threading.current_thread().name, trainer.step))
                return real_search(*args)

            trainer.miner._search = search
        losses = [
            trainer.reduce_losses(trainer.train_step(*divmod(i, trainer.steps_per_epoch))) for i in range(5)
        ]
        assert searches == ([("MainThread", s) for s in (0, 2, 4)] if mined else [])
        runs.append((losses, [p.detach().clone() for p in trainer.cross.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_a_match_head_reranker_learns_and_keeps_its_scale_trainable_under_adapters(
    tmp_path, tiny_model_dir, toy_pairs
):
    """``cross_head="match"`` trains like the MLP head; with adapters its learnt scale still trains."""
    from coreply.adapters import add_lora
    from coreply.models import CrossEncoder

    model = ModelConfig(base_model=str(tiny_model_dir), dropout=0.0, cross_head="match")
    cfg = config(
        tmp_path,
        tiny_model_dir,
        mode="independent",
        models="cross",
        model=model,
        batch_size=8,
        max_steps=40,
        eval_every=20,
        valid_size=16,
    )
    summary = Trainer(cfg, toy_pairs, toy_pairs[:16], pool_of(toy_pairs)).fit()
    start = records(tmp_path / "run")[0]["valid"]["cross"]["hits@1"]
    assert summary["best_valid_hits@1"]["cross"] >= start + 20
    assert load_checkpoint(tmp_path / "run" / "cross").config.cross_head == "match"
    adapted = CrossEncoder.from_pretrained(model)
    add_lora(adapted, 4, 8.0)
    assert "head.log_scale" in trainable_state(adapted)


def test_cpu_bf16_trains_under_autocast_with_fp32_weights(
    tmp_path, tiny_model_dir, toy_pairs, monkeypatch, caplog
):
    """``--cpu-bf16``: a CPU step runs its models under bf16 autocast, as CUDA's do (the step's losses are
    bf16's, near fp32's and not equal to them), the weights stay fp32, a resumed run may turn it on or
    off, and a CPU without bf16 instructions is warned."""
    losses = {}
    for bf16 in (False, True):
        out = str(tmp_path / str(bf16))
        trainer = Trainer(
            config(tmp_path, tiny_model_dir, cpu_bf16=bf16, output_dir=out), toy_pairs, [], pool_of(toy_pairs)
        )
        trainer.bi.eval(), trainer.cross.eval()  # no dropout: the same step but for the precision
        losses[bf16] = trainer.reduce_losses(trainer.train_step(0, 0))
        assert all(p.dtype == torch.float32 for p in [*trainer.bi.parameters(), *trainer.cross.parameters()])
    fp32, bf16 = losses[False], losses[True]
    assert fp32.keys() == bf16.keys() and any(bf16[k] != fp32[k] for k in fp32)
    assert all(abs(bf16[k] - fp32[k]) < 0.05 * max(1.0, abs(fp32[k])) for k in fp32), (fp32, bf16)
    assert "cpu_bf16" in RESUMABLE

    monkeypatch.setattr(trainer_module, "cpu_has_bf16_dot", lambda: False)
    cfg = config(tmp_path, tiny_model_dir, cpu_bf16=True, output_dir=str(tmp_path / "slow"))
    Trainer(cfg, toy_pairs, [], pool_of(toy_pairs))
    assert "--cpu-bf16: this CPU has no bf16 instructions" in caplog.text
