"""Metadata filters: what a filter matches, and that a filtered search answers exactly as a pool holding
only the allowed responses would (the same responses in the same order, with every stage)."""

import math
import random
import re
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from conftest import best_within, toy_pool

import coreply.bundle
from coreply.bundle import load_bundle, make_backend, search_on, search_within
from coreply.filters import LOGICAL, OPERATORS, FilterError, MetadataIndex
from coreply.prior import Prior
from coreply.ranking import Query
from coreply.responder import Responder
from index_builder.build import build_bundle

POOL = [
    {"intent": "refund", "locale": "en", "tags": ["billing", "vip"]},
    {"intent": "refund", "locale": "de", "tier": 1},
    {"intent": "greeting", "locale": "en", "tier": 1.0, "vip": True},
    {"intent": "greeting", "vip": 1, "extra": {"nested": "never matched"}},
    {},
]


def ids(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(mask).tolist()


def test_a_filter_matches_every_field_and_any_of_a_fields_values():
    index = MetadataIndex(POOL)
    assert ids(index.allowed({})) == [0, 1, 2, 3, 4]
    assert ids(index.allowed({"intent": "refund"})) == [0, 1]
    assert ids(index.allowed({"intent": "refund", "locale": "en"})) == [0]
    assert ids(index.allowed({"locale": ["de", "en"]})) == [0, 1, 2]
    assert ids(index.allowed({"tags": "vip"})) == [0]  # a list in the pool matches by its items
    assert ids(index.allowed({"tags": ["billing", "vip"]})) == [0]
    assert ids(index.allowed({"intent": "farewell"})) == []  # a value nobody has: no match, no error


def test_values_compare_as_json_values():
    index = MetadataIndex(POOL)
    assert ids(index.allowed({"tier": 1})) == ids(index.allowed({"tier": 1.0})) == [1, 2]
    assert ids(index.allowed({"vip": True})) == [2]  # true is not 1
    assert ids(index.allowed({"vip": 1})) == [3]
    assert ids(index.allowed({"tier": "1"})) == []  # text is not a number


def test_operators_match_as_their_names_say():
    index = MetadataIndex(POOL)
    assert ids(index.allowed({"intent": {"$eq": "refund"}})) == ids(index.allowed({"intent": "refund"}))
    assert ids(index.allowed({"intent": {"$ne": "refund"}})) == [2, 3, 4]  # 4 has no intent
    assert ids(index.allowed({"locale": {"$in": ["de", "fr"]}})) == [1]
    assert ids(index.allowed({"tags": {"$nin": ["vip", "x"]}})) == [1, 2, 3, 4]  # no item is one of them
    assert ids(index.allowed({"tier": {"$gt": 1}})) == []
    assert ids(index.allowed({"tier": {"$gte": 1}})) == [1, 2]
    assert ids(index.allowed({"tier": {"$lt": 1.5, "$gt": 0.5}})) == [1, 2]
    assert ids(index.allowed({"vip": {"$lte": 1}})) == [3]  # true is no number
    assert ids(index.allowed({"locale": {"$exists": False}, "intent": {"$exists": True}})) == [3]


def test_the_index_describes_the_fields_a_filter_can_name():
    assert MetadataIndex(POOL).describe() == (
        "intent (2 values), locale (2 values), tags (2 values), tier (1 value, numbers 1 to 1), "
        "vip (2 values, numbers 1 to 1)"
    )
    said = MetadataIndex([{"price": 0.5}, {"price": [99, "n/a"]}, {"price": -3}]).describe()
    assert said == "price (4 values, numbers -3 to 99)"
    assert MetadataIndex([{}, {"x": None}]).describe().startswith("none (the pool file gave no fields")


def meets(record: dict, name: str, op: str, operand) -> bool:
    """The reference: one response's field against one operator, written out case by case."""
    held = record.get(name)
    items = [x for x in (held if isinstance(held, list) else [held]) if isinstance(x, str | int | float)]
    numbers = [float(x) for x in items if not isinstance(x, bool | str)]

    def kind(x) -> type:  # JSON's kinds: a boolean is no number
        return bool if isinstance(x, bool) else str if isinstance(x, str) else float

    def equal(value) -> bool:
        return any(kind(x) is kind(value) and x == value for x in items)

    match op:
        case "$eq" | "$ne":
            return equal(operand) == (op == "$eq")
        case "$in" | "$nin":
            return any(equal(v) for v in operand) == (op == "$in")
        case "$gt":
            return any(x > operand for x in numbers)
        case "$gte":
            return any(x >= operand for x in numbers)
        case "$lt":
            return any(x < operand for x in numbers)
        case "$lte":
            return any(x <= operand for x in numbers)
        case "$exists":
            return bool(items) == operand
    raise AssertionError(op)


def satisfies(record: dict, where: dict) -> bool:
    """The reference for a whole filter: every name met, the logical operators read as their names say."""
    for name, condition in where.items():
        if name == "$not":
            met = not satisfies(record, condition)
        elif name in ("$and", "$or"):
            met = (all if name == "$and" else any)(satisfies(record, f) for f in condition)
        elif isinstance(condition, dict):
            met = all(meets(record, name, op, operand) for op, operand in condition.items())
        else:
            met = meets(record, name, "$in", condition if isinstance(condition, list) else [condition])
        if not met:
            return False
    return True


@pytest.fixture(scope="module")
def random_pool() -> list[dict]:
    """300 responses whose fields f and g hold numbers, booleans, texts, lists of them, nulls, objects,
    or nothing."""
    rng = np.random.default_rng(0)
    kinds = [0, 1, 2, 2.5, 3, True, False, "a", "b", "2", None, {"x": 1}]

    def value():
        pick = rng.integers(len(kinds) + 2)
        if pick == len(kinds):
            return [kinds[i] for i in rng.integers(len(kinds), size=rng.integers(0, 4))]
        return kinds[pick] if pick < len(kinds) else "absent"

    pool = [{n: v for n in ("f", "g") if (v := value()) != "absent"} for _ in range(300)]
    pool[0] = {"f": 1, "g": 1}  # each field holds a number somewhere
    return pool


def random_condition(rng: np.random.Generator) -> dict:
    """One field under one operator, or a plain value or list, drawn from what the random pool holds."""
    scalars = [0, 1, 2, 2.5, 4, -1, True, False, "a", "2", "zz"]
    name, op = str(rng.choice(["f", "g"])), str(rng.choice([*OPERATORS, "plain"]))
    if op in ("$in", "$nin"):
        operand = [scalars[i] for i in rng.integers(len(scalars), size=rng.integers(1, 4))]
    elif op in ("$gt", "$gte", "$lt", "$lte"):
        operand = [0, 1, 2, 2.5, -1, 3.5][rng.integers(6)]
    elif op == "$exists":
        operand = bool(rng.integers(2))
    else:
        operand = scalars[rng.integers(len(scalars))]
    return {name: operand} if op == "plain" else {name: {op: operand}}


def test_every_operator_matches_as_the_reference_does_over_a_random_pool(random_pool):
    rng = np.random.default_rng(1)
    index = MetadataIndex(random_pool)
    checked = 0
    for _ in range(400):
        where = random_condition(rng)
        got = ids(index.allowed(where))
        assert got == [i for i, record in enumerate(random_pool) if satisfies(record, where)], where
        checked += len(got)
    assert checked > 10_000  # the draws allowed something, not only nothing


def test_and_or_not_combine_filters_as_the_reference_does(random_pool):
    rng = np.random.default_rng(2)
    index = MetadataIndex(random_pool)

    def random_filter(depth: int) -> dict:
        pick = rng.integers(5 if depth < 3 else 1)
        if pick == 0:
            return random_condition(rng)
        if pick == 1:
            return {"$not": random_filter(depth + 1)}
        if pick == 2:
            return random_condition(rng) | random_condition(rng)  # two fields (or one, twice)
        op = "$and" if pick == 3 else "$or"
        return {op: [random_filter(depth + 1) for _ in range(rng.integers(1, 4))]}

    drawn, shares = [], []
    for _ in range(300):
        drawn.append(where := random_filter(0))
        got = ids(index.allowed(where))
        assert got == [i for i, record in enumerate(random_pool) if satisfies(record, where)], where
        shares.append(len(got) / len(random_pool))
    nested = [w for w in drawn if any(op in str(w) for op in LOGICAL)]
    assert len(nested) > 100 and all(sum(op in str(w) for w in drawn) > 30 for op in LOGICAL)
    assert 0.1 < np.mean(shares) < 0.9  # the filters allowed some and barred some


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ({"intnet": "refund"}, "intnet: no response in this pool has this field (fields: intent, locale,"),
        ({"extra": "x"}, "extra: no response in this pool has this field"),  # objects are never indexed
        ({"intent": []}, "intent: an empty list of values matches nothing"),
        ({"intent": [{"nested": 1}]}, "intent: {'nested': 1} is not a text, number or boolean"),
        ({"intent": {}}, "intent: an object of operators names none ($eq, $ne, $in,"),
        ({"intent": {"eq": "refund"}}, "intent.eq: not an operator (operators: $eq, $ne, $in,"),
        ({"intent": {"$eq": ["refund"]}}, "intent.$eq: takes one value; $in takes a list"),
        ({"intent": {"$ne": ["refund"]}}, "intent.$ne: takes one value; $nin takes a list"),
        ({"intent": {"$nin": "refund"}}, "intent.$nin: takes a list of 1 or more values"),
        ({"intent": {"$in": []}}, "intent.$in: takes a list of 1 or more values"),
        ({"intent": {"$in": [None]}}, "intent.$in: None is not a text, number or boolean"),
        ({"intent": {"$gt": 1}}, "intent.$gt: compares numbers, and no response holds a number"),
        ({"tier": {"$lt": "2"}}, "tier.$lt: takes a finite number, not '2'"),
        ({"tier": {"$lte": True}}, "tier.$lte: takes a finite number, not True"),
        ({"tier": {"$gte": float("nan")}}, "tier.$gte: takes a finite number, not nan"),
        ({"tier": {"$exists": 1}}, "tier.$exists: takes true or false, not 1"),
        ({"$or": [{"intent": "refund"}, {"intnet": "x"}]}, "$or.1.intnet: no response in this pool has"),
        ({"$not": {"tier": {"$gt": "1"}}}, "$not.tier.$gt: takes a finite number"),
        ({"$or": []}, "$or: takes a list of 1 or more filters"),
        ({"$and": {"intent": "refund"}}, "$and: takes a list of 1 or more filters"),
        ({"$not": ["intent"]}, "$not: takes a filter"),
        ({"$nor": [{"intent": "refund"}]}, "$nor: not a logical operator ($and, $or, $not); a field's"),
        ({"$gt": 1}, "$gt: not a logical operator"),
        ({"$not": {"$not": {"$not": {"$not": {"$not": {}}}}}}, "$not.$not.$not.$not.$not: filters nested"),
        ({"intent": ["refund"] * 257}, "intent: 257 values; a list may hold at most 256"),
        ({"$or": [{"tier": 1}] * 64}, "$or.0.tier: the filter holds more than 64 conditions in all"),
    ],
)
def test_a_filter_that_cannot_match_as_meant_is_refused_naming_the_field(where, says):
    with pytest.raises(FilterError, match=re.escape(says)):
        MetadataIndex(POOL).allowed(where)


@pytest.fixture(scope="module")
def ivf_bundle(tmp_path_factory, tiny_core):
    """The tiny retriever over the toy pool in an approximate FAISS index, probed exhaustively."""
    path = tmp_path_factory.mktemp("bundles") / "ivf"
    pool = toy_pool()
    build_bundle(
        path, pool, bi=str(tiny_core / "bi"), factory="IVF2,Flat", search_params="nprobe=2", onnx="none",
        progress=False,
    )  # fmt: skip
    return path


@pytest.mark.parametrize("name", ["tiny_bundle", "guarded_bundle", "lexical_bundle", "prior", "ivf_bundle"])
def test_a_filtered_request_answers_as_a_pool_of_the_allowed_responses_alone(name, request, toy_pairs):
    """The pool without the other responses is the same bundle with them withdrawn, which every stage
    already treats as absent; a filter must give the same answers, in the same order, with the same
    scores, whatever the stages (exact or approximate search, guard, lexical stage, prior, reranker)."""
    bundle = load_bundle(request.getfixturevalue("tiny_bundle" if name == "prior" else name))
    bundle = search_on(bundle, "cpu")
    size = len(bundle.texts)
    if name == "prior":  # a strong prior, so that it reorders
        bundle = replace(bundle, prior=Prior(1.0, np.random.default_rng(0).random(size, dtype="float32")))
    metadata = [{"half": i % 2, "tags": ["a"] if i % 3 else ["b"]} for i in range(size)]
    bundle = replace(bundle, metadata=metadata)
    backend = make_backend(bundle, "torch")
    for where, withdrawn in (({"half": 1}, ()), ({"half": 0, "tags": "a"}, (0, 1, 4))):  # 4 is allowed
        allowed = bundle.filters.allowed(where)
        alone = Responder(replace(bundle, withdrawn=frozenset(ids(~allowed)) | set(withdrawn)), backend)
        filtered = Responder(replace(bundle, withdrawn=frozenset(withdrawn)), backend)
        for pair in toy_pairs[:6]:
            expected = alone.respond(pair.context, top_k=size, n_candidates=size)
            got = filtered.respond(pair.context, top_k=size, n_candidates=size, filter=where)
            assert [r.id for r in got] == [r.id for r in expected] and all(allowed[r.id] for r in got)
            assert not set(withdrawn) & {r.id for r in got}
            np.testing.assert_allclose([r.score for r in got], [r.score for r in expected], rtol=1e-5)


def test_filtered_and_whole_pool_queries_share_a_batch_as_each_would_run_alone(tiny_bundle, toy_pairs):
    bundle = search_on(load_bundle(tiny_bundle), "cpu")
    bot = Responder(bundle, make_backend(bundle, "torch"))
    size = len(bundle.texts)
    allow = np.zeros(size, dtype=bool)
    allow[[1, 4, 5]] = True
    queries = [
        Query(toy_pairs[0].context, allow=allow),
        Query(toy_pairs[1].context),
        Query(toy_pairs[2].context, allow=np.zeros(size, dtype=bool)),  # a filter that allows nothing
    ]
    together = bot.pipeline.recall(queries, [5, 5, 5])
    for query, got in zip(queries, together, strict=True):
        (alone,) = bot.pipeline.recall([query], [5])
        assert got.ids.tolist() == alone.ids.tolist()
        np.testing.assert_allclose(got.retrieval, alone.retrieval, rtol=1e-5)
    assert set(together[0].ids.tolist()) <= {1, 4, 5} and len(together[1].ids) == 5
    assert len(together[2].ids) == 0


@pytest.mark.parametrize("factory", ["IVF16,Flat", "HNSW16"])
def test_a_broad_filter_over_an_approximate_index_restricts_its_own_search(monkeypatch, factory):
    """Past EXACT_WITHIN allowed rows an IVF or HNSW index searches within the filter itself, with the
    settings it searches with unfiltered (searching every list, or a wide beam, it finds what brute force
    finds); a query it leaves short is searched exactly, and a narrow filter is searched exactly."""
    import faiss

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((2000, 16)).astype("float32")
    queries = rng.standard_normal((3, 16)).astype("float32")
    index = faiss.index_factory(16, factory, faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)
    index.add(vectors)
    if factory.startswith("IVF"):
        index.make_direct_map()
    allow = rng.random((3, 2000)) < [[0.5], [0.2], [0.002]]
    few = int(allow[2].sum())  # fewer than k, searched exactly
    searched: list[int] = []  # the queries the index searched itself
    search = index.search
    monkeypatch.setattr(
        index, "search", lambda q, k, params: searched.append(len(q)) or search(q, k, params=params)
    )
    monkeypatch.setattr(coreply.bundle, "EXACT_WITHIN", 100)

    faiss.ParameterSpace().set_index_parameters(
        index, "nprobe=16" if factory.startswith("IVF") else "efSearch=400"
    )
    want = best_within(vectors, queries, 10, allow)
    scores, got = search_within(index, queries, 10, allow)
    np.testing.assert_array_equal(got, want)
    assert searched == [1, 1] and 0 < few < 10 and (got[2] == -1).sum() == 10 - few
    assert np.isinf(scores[2, few:]).all()

    narrow = faiss.ParameterSpace()  # one list, or a beam of one: a 20 % filter comes back short from it
    narrow.set_index_parameters(index, "nprobe=1" if factory.startswith("IVF") else "efSearch=1")
    got = search_within(index, queries, 200, allow)[1]
    assert (got[:2] >= 0).all() and all(allow[i, got[i, got[i] >= 0]].all() for i in range(3))
    np.testing.assert_array_equal(got[:2, :10], want[:2])  # each short one searched again, exactly


def test_any_json_either_filters_or_is_refused_as_a_filter_error():
    """What a client may send (any JSON, odd numbers, operator names in the wrong places) comes back as a
    mask or a FilterError, which the service answers with a 422; any other exception would be a 500."""
    rng = random.Random(0)
    index = MetadataIndex([{"intent": "refund", "tags": ["a", 1], "price": 3}, {"price": [1.5, 10**30]}, {}])
    atoms = [None, True, 0, -1, 2.5, math.inf, math.nan, 10**400, "", "refund", "$in", "price", "tags"]
    names = ["intent", "price", "tags", "nope", "", *OPERATORS, *LOGICAL, "$x"]

    def draw(depth: int = 0):
        pick = rng.random()
        if depth > 4 or pick < 0.4:
            return rng.choice(atoms)
        if pick < 0.7:
            return [draw(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(names): draw(depth + 1) for _ in range(rng.randint(0, 3))}

    outcomes = Counter()
    for _ in range(20_000):
        try:
            index.allowed({rng.choice(names): draw() for _ in range(rng.randint(0, 3))})
            outcomes["filtered"] += 1
        except FilterError:
            outcomes["refused"] += 1
    assert outcomes["filtered"] > 2_000 and outcomes["refused"] > 2_000, outcomes
