"""Schema-based fuzzing of the real server at volume: requests generated from /openapi.json
(schemathesis + hypothesis, valid and invalid), every response checked for a 5xx and against the schema.
The one 5xx allowed is the documented 504 for a request whose own X-Request-Timeout-Ms ran out.

    python bench/fuzz.py --bundle artifacts/default-bundle --cases 10000 --out docs/fuzz-cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from bench import Server, provenance, refuse_below  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True)
    p.add_argument("--cases", type=int, default=10_000, help="generated requests for POST /respond")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    refuse_below(args, cases=1)

    server = Server(args.bundle, threads=1)
    codes: Counter[str] = Counter()
    failures: list[str] = []
    deadline_504s = [0]
    started = time.perf_counter()
    try:
        api = schemathesis.openapi.from_url(server.url + "/openapi.json")
        for result in api.get_all_operations():
            operation = result.ok()
            cases = args.cases if operation.path == "/respond" else max(100, args.cases // 100)

            @given(case=operation.as_strategy())
            @settings(
                max_examples=cases, deadline=None, suppress_health_check=list(HealthCheck), database=None
            )
            def run(case):
                response = case.call(base_url=server.url)
                codes[f"{case.operation.method.upper()} {case.operation.path} {response.status_code}"] += 1
                deadline_504 = response.status_code == 504 and "X-Request-Timeout-Ms" in (case.headers or {})
                deadline_504s[0] += deadline_504
                try:
                    case.validate_response(response, checks=CHECKS[1:] if deadline_504 else CHECKS)
                except Exception as exc:  # recorded, and the run goes on
                    failures.append(f"{case.operation.path}: {str(exc)[:500]}")

            run()
    finally:
        server.stop()
    total = sum(codes.values())
    report = {
        **provenance(),
        "requests": total,
        "seconds": round(time.perf_counter() - started, 1),
        "status_codes": dict(sorted(codes.items())),
        "client_deadline_504": deadline_504s[0],
        "other_5xx": sum(n for k, n in codes.items() if k.split()[-1].startswith("5")) - deadline_504s[0],
        "failures": failures,
    }
    write_json_atomic(args.out, report, sort_keys=False)
    summary = {k: v for k, v in report.items() if k != "failures"} | {"failures": len(failures)}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
