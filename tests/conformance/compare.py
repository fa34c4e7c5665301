"""Compares a conformance run's checks with expected-failures.txt.

Usage: python3 compare.py RESULTS_DIR EXPECTED_FILE
Exit 1 on a failing check that is not expected, or an expected one that now passes (the list
must stay honest); 0 otherwise. Prints one line per check that did not pass and a summary.
A WARNING (a SHOULD not met) fails nothing unless listed; a listed WARNING is expected like a
failure, so that the suite's own baseline (which counts warnings) can name its scenario.
"""

import json
import re
import sys
from pathlib import Path

FAILING = {"FAILURE", "ERROR"}
NOT_PASSING = FAILING | {"WARNING"}


# The suite names each run `server-<scenario>-<ISO timestamp>`, e.g.
# `server-ping-2026-11-29T17-55-16-203Z`: the timestamp is everything from `-YYYY-MM-DDT` on
# (a search for the last "-20" would also stop inside the milliseconds).
TIMESTAMP = re.compile(r"-\d{4}-\d{2}-\d{2}T.*$")


def scenario_of(run_dir: Path) -> str:
    return TIMESTAMP.sub("", run_dir.name.removeprefix("server-"))


def main() -> int:
    results, expected_file = Path(sys.argv[1]), Path(sys.argv[2])
    expected: dict[tuple[str, str], str] = {}
    for line in expected_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        scenario, check, *why = line.split(maxsplit=2)
        expected[(scenario, check)] = why[0] if why else ""

    runs = sorted(p.parent for p in results.rglob("checks.json"))
    if not runs:
        print(f"conformance: no results under {results}; did the suite run?")
        return 1
    seen: dict[tuple[str, str], str] = {}
    for run in runs:
        scenario = scenario_of(run)
        for check in json.loads((run / "checks.json").read_text()):
            key = (scenario, check["id"])
            status = check["status"]
            # A check repeated within a scenario fails if any instance fails.
            if seen.get(key) not in FAILING and not (status == "SUCCESS" and key in seen):
                seen[key] = status
            if (status in FAILING and key not in expected) or status == "WARNING":
                msg = (check.get("errorMessage") or check.get("description") or "").splitlines()
                print(f"  {status:8} {scenario} {check['id']}: {msg[0][:160] if msg else ''}")

    unexpected = sorted(k for k, s in seen.items() if s in FAILING and k not in expected)
    fixed = sorted(k for k in expected if k in seen and seen[k] not in NOT_PASSING)
    missing = sorted(k for k in expected if k not in seen)
    passed = sum(1 for s in seen.values() if s == "SUCCESS")
    failed = sum(1 for s in seen.values() if s in FAILING)
    warned = sum(1 for s in seen.values() if s == "WARNING")
    for k in unexpected:
        print(f"UNEXPECTED FAILURE: {k[0]} {k[1]} (fix it, or list it with a reason)")
    for k in fixed:
        print(f"NOW PASSES: {k[0]} {k[1]} (remove it from expected-failures.txt)")
    for k in missing:
        print(f"NOT RUN: {k[0]} {k[1]} (listed as expected but the suite did not run it)")
    print(
        f"conformance: {passed} passed, {failed} failed "
        f"({failed - len(unexpected)} expected, {len(unexpected)} unexpected), {warned} warnings, "
        f"{len(fixed)} expected failures now pass, {len(missing)} listed checks not run"
    )
    return 1 if unexpected or fixed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
