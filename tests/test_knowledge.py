"""Knowledge-grounded ranking (issue #16, RecKGC): the grounded input layout, the persona split's
leakage rules, the knowledge retriever's pick, reciprocal learning's two losses, training end to end on
the tiny model, and knowledge through a bundle, the service and the CLI."""

import gzip
import json

import pytest
import torch
from conftest import TOPICS
from fastapi.testclient import TestClient

from coreply.checkpoint import load_checkpoint
from coreply.config import ModelConfig
from coreply.corpus import Pair, split_of
from coreply.knowledge import KnowledgeSelector, load_chitchat_persona
from coreply.models import BiEncoder, CrossEncoder
from coreply.responder import Responder
from coreply.text import unigram_f1
from evaluation.grounded import evaluate_grounded, significance
from service.app import create_app
from service.settings import Settings
from training.reciprocal import GroundedConfig, ranker_feedback, retriever_loss, train_grounded

FILLER = ["i live in a city", "i work at a school", "i study at night"]


def grounded_pairs() -> list[Pair]:
    """The context never tells the topic; one knowledge sentence does (beside two fillers)."""
    pairs = []
    for r in range(6):
        for name, (_, answer) in TOPICS.items():
            knowledge = (FILLER[r % 3], answer.replace("i ", ""), FILLER[(r + 1) % 3])
            pairs.append(Pair(("hello", "tell me about you"), answer, f"{name}-{r}", knowledge=knowledge))
    return pairs


def train_toy(out, tiny_model_dir, knowledge: str, steps: int = 60) -> dict:
    model = ModelConfig(base_model=str(tiny_model_dir), dropout=0.0, max_knowledge_tokens=32)
    config = GroundedConfig(
        output_dir=str(out), knowledge=knowledge, model=model, top_m=2, num_negatives=3, batch_size=8,
        max_steps=steps, eval_every=30, valid_size=16, valid_candidates=4, lr=3e-3, retriever_lr=1e-3,
        device="cpu", log_every=30,
    )  # fmt: skip
    pairs = grounded_pairs()
    return train_grounded(config, pairs, pairs[:16])


@pytest.fixture(scope="module")
def reciprocal_run(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("grounded") / "reciprocal"
    train_toy(out, tiny_model_dir, "reciprocal")
    return out


# ----------------------------------------------------------------------------------------- input


def test_grounded_pair_layout_and_knowledge_budget(tiny_model_dir):
    cross = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), max_knowledge_tokens=8))
    tok = cross.tokenizer
    cls, sep = tok.cls, tok.sep
    k1, k2, ctx, resp = tok.pieces(["pizza and pasta", "a dog and a cat", "hello", "yes"])
    ((row, start),) = tok.pair_rows([["hello"]], ["yes"], [["pizza and pasta", "a dog and a cat"]])
    kept = [*k1, sep, *k2][:7]  # knowledge is cut at the end to 8 tokens with the [SEP] after it
    assert len(kept) < len(k1) + len(k2) + 1 and kept[-1] != sep
    assert row == [cls, *kept, sep, *ctx, sep, *resp, sep]
    assert start == len(row) - len(resp) - 1  # the response segment starts after the context's [SEP]
    ((bare, _),) = tok.pair_rows([()], ["yes"], [["pizza and pasta"]])  # the reciprocal learner's feedback
    assert bare == [cls, *k1, sep, *resp, sep]
    plain = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir))).tokenizer
    assert plain.pair_rows([["hello"]], ["yes"], [["pizza"]]) == plain.pair_rows([["hello"]], ["yes"])


def test_unigram_f1():
    assert unigram_f1("I love pizza", "i love pizza") == 1.0
    assert unigram_f1("pizza", "i love pizza") == pytest.approx(0.5)
    assert unigram_f1("dogs", "i love pizza") == 0.0


# ------------------------------------------------------------------------------------------ data


def _conversation(prompt: str, turns: list[tuple[str, str]]) -> dict:
    return {"prompt": prompt, "messages": [[{"text": t, "sender": s, "timestamp": ""}] for s, t in turns]}


def test_persona_split_never_grounds_a_conversation_in_itself_or_in_held_out_text(tmp_path):
    ids = {"train": [], "test": []}
    n = 0
    while len(ids["train"]) < 2 or not ids["test"]:
        name = f"c{n}"
        if split_of(name) in ids:
            ids[split_of(name)].append(name)
        n += 1
    a, b, t = ids["train"][0], ids["train"][1], ids["test"][0]
    data = {
        a: _conversation(
            "pets?", [("x", "do you have pets at home"), ("amy", "i have two big dogs at home")]
        ),
        b: _conversation("", [("x", "what do you do for work"), ("amy", "i work nights as a nurse here")]),
        t: _conversation("food?", [("x", "what food do you like"), ("amy", "i really love spicy thai food")]),
    }
    path = tmp_path / "chitchat.json"
    path.write_text(json.dumps(data))
    splits = load_chitchat_persona(path=path)
    by_id = {p.conversation_id: p for split in splits.values() for p in split}
    assert by_id[a].knowledge == ("pets?", "i work nights as a nurse here")  # prompt, b's; never a's own
    assert by_id[b].knowledge == ("i have two big dogs at home",)  # no prompt; a's message
    assert by_id[t].knowledge[0] == "food?" and set(by_id[t].knowledge[1:]) == {
        "i have two big dogs at home",
        "i work nights as a nurse here",
    }
    held_out = "i really love spicy thai food"
    assert all(held_out not in p.knowledge for p in splits["train"])  # test text never grounds anything


# ------------------------------------------------------------------------------- reciprocal learning


def test_selector_returns_the_top_m_best_first(tiny_model_dir):
    bi = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), share_towers=True))
    knowledge = ["i love pizza", "a dog and a cat", "it is sunny", "i play tennis"]
    selector = KnowledgeSelector(bi.eval(), top_m=2)
    (scores,) = selector.scores([["what food ?"]], [knowledge])
    (picked,) = selector([["what food ?"]], [knowledge])
    best = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert picked == tuple(knowledge[i] for i in best)


def test_retriever_loss_moves_probability_to_what_the_ranker_credits(tiny_model_dir):
    """Eq. 12: one step on L_phi raises p(k | C) of the sentence with the larger feedback weight."""
    torch.manual_seed(0)  # the heads start random: without a seed the result hung on earlier tests' draws
    bi = BiEncoder.from_pretrained(
        ModelConfig(base_model=str(tiny_model_dir), share_towers=True, dropout=0.0)
    )
    pair = Pair(("tell me about you",), "i love pizza and pasta", knowledge=("pizza and pasta", "it is cold"))
    picked = [pair.knowledge]
    cross = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), max_knowledge_tokens=16))
    (weights,) = ranker_feedback(cross, picked, [[pair.response, "ok then"]], "f1")
    assert weights[0] > weights[1] == 0  # unigram F1 credits the sentence the gold reply echoes

    def p_first() -> float:
        with torch.no_grad():
            ctx = bi.encode_context(bi.tokenizer.contexts([pair.context]))
            k = bi.encode_response(bi.tokenizer.responses(list(pair.knowledge)))
            return torch.softmax((k @ ctx[0]) / k.shape[-1] ** 0.5 / 0.2, 0)[0].item()

    before = p_first()
    optimizer = torch.optim.SGD(bi.parameters(), lr=0.5)
    retriever_loss(bi.train(), [pair], picked, [weights], tau=0.2).backward()
    optimizer.step()
    assert p_first() > before


def test_knowledge_helps_a_ranker_that_needs_it(tmp_path, tiny_model_dir, reciprocal_run):
    """On the toy task only the knowledge says which reply fits: reading all of it beats reading none,
    and the reciprocal run learned too; each run saves what its setting needs."""
    none = train_toy(tmp_path / "none", tiny_model_dir, "none")
    every = train_toy(tmp_path / "all", tiny_model_dir, "all")
    assert every["best_valid"]["hits@1"] >= none["best_valid"]["hits@1"] + 25
    assert not load_checkpoint(tmp_path / "none" / "cross").reads_knowledge
    assert not (tmp_path / "all" / "knowledge").exists()
    summary = json.loads((reciprocal_run / "summary.json").read_text())
    assert summary["best_valid"]["hits@1"] >= none["best_valid"]["hits@1"] + 25
    lines = [json.loads(line) for line in (reciprocal_run / "metrics.jsonl").read_text().splitlines()]
    assert all("loss_retriever" in line for line in lines)
    assert load_checkpoint(reciprocal_run / "knowledge").config.share_towers


def test_grounded_evaluation_with_and_without_knowledge(reciprocal_run):
    cross = load_checkpoint(reciprocal_run / "cross")
    retriever = load_checkpoint(reciprocal_run / "knowledge")
    pairs = grounded_pairs()
    negatives = [p.response for p in pairs]
    grounded = evaluate_grounded("grounded", cross, retriever, pairs, negatives, 4, top_m=2)
    withheld = evaluate_grounded(
        "withheld", cross, retriever, pairs, negatives, 4, top_m=2, use_knowledge=False
    )
    assert grounded["meta"]["knowledge"] == "retrieved top-2" and withheld["meta"]["knowledge"] == "none"
    assert grounded["metrics"]["hits@1"] > withheld["metrics"]["hits@1"]
    assert significance(grounded, withheld)["hits@1"] < 0.05
    other = evaluate_grounded("other", cross, retriever, pairs, negatives, 4, top_m=2, seed=1)
    with pytest.raises(ValueError, match="other cases"):
        significance(grounded, other)


# --------------------------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def grounded_bundle(tmp_path_factory, tiny_core, reciprocal_run):
    from index_builder.build import build_bundle

    out = tmp_path_factory.mktemp("grounded-bundle") / "b"
    pool = [answer for _, answer in TOPICS.values()]
    build_bundle(
        out, pool, bi=str(tiny_core / "bi"), cross=str(reciprocal_run / "cross"),
        knowledge_retriever=str(reciprocal_run / "knowledge"), knowledge=["love pizza and pasta", *FILLER],
        top_m=2, progress=False,
    )  # fmt: skip
    return out


def test_bundle_serves_the_knowledge_evaluation_reads(grounded_bundle, reciprocal_run):
    """The bundle's knowledge retriever picks from the request's knowledge (or the bundle's default) and
    the reranker scores exactly what evaluation scores with that pick."""
    responder = Responder.load(grounded_bundle, backend="torch")
    assert responder.pipeline.reads_knowledge and responder.pipeline.select_knowledge is not None
    assert responder.bundle.knowledge == ["love pizza and pasta", *FILLER]
    cross = load_checkpoint(reciprocal_run / "cross")
    selector = KnowledgeSelector(load_checkpoint(reciprocal_run / "knowledge"), top_m=2)
    context = ["hello", "tell me about you"]
    scores = {}
    for knowledge in (None, ["yes have a dog and a cat", *FILLER]):
        replies = responder.respond(context, 8, 8, "rerank", knowledge=knowledge)
        (picked,) = selector([context], [knowledge or responder.bundle.knowledge])
        want = cross.score_pairs([context] * 8, [r.text for r in replies], [picked] * 8)
        got = [r.rerank_score for r in replies]
        assert got == pytest.approx(want.tolist(), abs=1e-4)
        scores[knowledge is None] = dict(zip([r.text for r in replies], got, strict=True))
    assert scores[True] != pytest.approx(scores[False], abs=1e-3)  # the knowledge changed the ranking input


def test_respond_with_knowledge_and_its_errors(grounded_bundle, tiny_bundle):
    settings = Settings(bundle=grounded_bundle, threads=1, max_knowledge=4, max_utterance_chars=50)
    body = {"context": ["hello", "tell me about you"], "n_candidates": 8, "fusion": "rerank"}
    body["knowledge"] = ["a dog and a cat"]
    with TestClient(create_app(settings)) as c:
        ok = c.post("/respond", json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["timings_ms"]["knowledge"] > 0
        default = c.post("/respond", json={k: v for k, v in body.items() if k != "knowledge"}).json()
        assert default["responses"] != ok.json()["responses"]  # the request's knowledge, not the bundle's
        assert c.get("/readyz").json()["knowledge"] == {
            "reads": True,
            "retriever": True,
            "default_sentences": 4,
        }
        for bad, field in (
            (["a"] * 5, "knowledge"),  # more than max_knowledge
            (["a" * 51], "knowledge.0"),  # longer than an utterance may be
            (["  "], "knowledge"),  # blank
            ("a dog", "knowledge"),  # not a list
        ):
            r = c.post("/respond", json=body | {"knowledge": bad})
            assert r.status_code == 422 and r.json()["error"].startswith(field), (bad, r.text)
        metrics = c.get("/metrics").text
        assert 'coreply_stage_duration_seconds_count{stage="knowledge"}' in metrics
        assert "knowledge" in json.dumps(
            c.get("/openapi.json").json()["components"]["schemas"]["RespondRequest"]
        )
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1))) as c:
        r = c.post("/respond", json={"context": ["hi"], "knowledge": ["i love pizza"]})
        assert r.status_code == 422 and "does not read knowledge" in r.json()["error"]
        assert r.json()["error"].startswith("knowledge")


def test_cli_ground_train_eval_and_index_build(tmp_path, tiny_model_dir, tiny_core, capsys):
    from cli.main import main

    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"context": list(p.context), "response": p.response, "knowledge": list(p.knowledge)})
            + "\n"
            for p in grounded_pairs()
        )
    )
    run = tmp_path / "run"
    common = ["--base-model", str(tiny_model_dir), "--device", "cpu"]
    args = [
        "ground",
        "train",
        "-o",
        str(run),
        "--data",
        str(data),
        "--knowledge",
        "frozen",
        "--max-steps",
        "4",
    ]
    assert main([*args, "--top-m", "2", "--valid-size", "0", "--max-knowledge-tokens", "32", *common]) == 0
    assert main([*args, *common]) == 2  # the run directory is taken
    assert "already holds a grounded run" in capsys.readouterr().err
    out = tmp_path / "eval.json"
    evaluate = ["ground", "eval", "--cross", str(run / "cross"), "--data", str(data), "--candidates", "4"]
    assert main([*evaluate, "--knowledge-retriever", str(run / "knowledge"), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["knowledge"] == "retrieved top-2"  # as trained
    packed = tmp_path / "eval.json.gz"  # --against reads a compressed result too
    packed.write_bytes(gzip.compress(out.read_bytes()))
    against = [*evaluate, "--out", str(tmp_path / "again.json"), "--name", "again", "--against", str(packed)]
    assert main(against) == 0
    assert set(json.loads((tmp_path / "again.json").read_text())["against"]["eval"]) == {"hits@1", "mrr"}
    (tmp_path / "list.json").write_text("[]")
    for bad, said in (
        ("missing.json", "cannot read it"),
        ("list.json", "not a `coreply ground eval` JSON"),
        ("eval.json", "evaluated on other cases"),  # with another --seed below
    ):
        assert (
            main(
                [
                    *evaluate,
                    "--out",
                    str(tmp_path / "x.json"),
                    "--seed",
                    "7",
                    "--against",
                    str(tmp_path / bad),
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert f"--against {tmp_path / bad}: {said}" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.json").exists()
    persona = tmp_path / "persona.txt"
    persona.write_text("pizza and pasta\n\n")
    build = [
        "index",
        "build",
        "--pool",
        str(tmp_path / "pool.txt"),
        "--bi",
        str(tiny_core / "bi"),
        "--device",
        "cpu",
    ]
    (tmp_path / "pool.txt").write_text("i love pizza and pasta\nit is sunny and hot\n")
    assert (
        main(
            [
                *build,
                "-o",
                str(tmp_path / "b1"),
                "--cross",
                str(tiny_core / "cross"),
                "--knowledge",
                str(persona),
            ]
        )
        == 2
    )
    assert "need a reranker that reads knowledge" in capsys.readouterr().err
    grounded = ["--cross", str(run / "cross"), "--knowledge-retriever", str(run / "knowledge")]
    assert main([*build, "-o", str(tmp_path / "b2"), *grounded, "--knowledge", str(persona)]) == 0
    assert json.loads((tmp_path / "b2" / "knowledge.json").read_text()) == {"sentences": ["pizza and pasta"]}
    assert json.loads((tmp_path / "b2" / "manifest.json").read_text())["knowledge"]["top_m"] == 2


def test_chat_sends_a_persona(tmp_path, grounded_bundle, tiny_bundle):
    import subprocess
    import sys

    persona = tmp_path / "persona.txt"
    persona.write_text("yes have a dog and a cat\ni live in a city\n")
    chat = [sys.executable, "-m", "cli", "chat", "--knowledge", str(persona), "--bundle"]
    done = subprocess.run(
        [*chat, str(grounded_bundle)], input="hello\n/quit\n", capture_output=True, text=True
    )
    assert done.returncode == 0 and "bot> " in done.stdout, done.stderr
    refused = subprocess.run([*chat, str(tiny_bundle)], input="hello\n", capture_output=True, text=True)
    assert refused.returncode == 2 and "does not read knowledge" in refused.stderr
