"""What reading a request's filter costs on the event loop: ``MetadataIndex.allowed`` over a pool the
size of the default's (124,141 responses) with four synthetic fields (a unique id, a price, three tags,
a locale), for filters from one field to the limits (64 conditions; 256 values a list).

    .venv/bin/python docs/filters-2026-12-07c/mask_cost.py
"""

import json
import time

import numpy as np

from coreply.filters import MetadataIndex

N = 124_141
rng = np.random.default_rng(0)
metadata = [
    {
        "id": f"r{i}",
        "price": float(rng.integers(0, 1000)) / 10,
        "tags": [str(t) for t in rng.integers(0, 50, size=3)],
        "locale": ["en", "de", "fr"][i % 3],
    }
    for i in range(N)
]
start = time.perf_counter()
index = MetadataIndex(metadata)
print(f"index built in {time.perf_counter() - start:.2f} s")
FILTERS = {
    "one field": {"locale": "en"},
    "a field's negation": {"locale": {"$ne": "en"}},
    "a range": {"price": {"$gte": 10, "$lt": 50}},
    "$or of two": {"$or": [{"locale": "en"}, {"tags": "7"}]},
    "256 ids": {"id": [f"r{i}" for i in range(256)]},
    "32 ranges in $and (64 conditions)": {"$and": [{"price": {"$gt": i / 2}} for i in range(32)]},
    "$or of 31 x 256 ids (64 conditions)": {
        "$or": [{"id": [f"r{j}" for j in range(256 * i, 256 * (i + 1))]} for i in range(31)]
    },
}
for name, where in FILTERS.items():
    index.allowed(where)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        allowed = index.allowed(where)
        times.append(time.perf_counter() - start)
    print(
        f"{name}: median {1000 * np.median(times):.2f} ms, {len(json.dumps(where)):,} bytes of JSON, "
        f"allows {int(allowed.sum()):,}"
    )
