"""A pytest plugin for the GPU acceptance's test stages (``-p pytest_outcomes``): it writes,
as pytest goes, each selected test and then each test's outcome, one JSON line each, to the
file ``ACCEPTANCE_TEST_LOG`` names. So a run killed at its time limit still says which tests
passed, which failed, and which never ran."""

from __future__ import annotations

import json
import os
from typing import Any

LOG = "ACCEPTANCE_TEST_LOG"


def _write(record: dict[str, str]) -> None:
    with open(os.environ[LOG], "a") as log:
        log.write(json.dumps(record) + "\n")


def pytest_collection_finish(session: Any) -> None:
    for item in session.items:
        _write({"test": item.nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    if (
        report.when == "call" or not report.passed
    ):  # a call's result, or setup's skip or error
        outcome = (
            report.outcome
            if report.when == "call"
            else ("skipped" if report.skipped else "error")
        )
        _write({"test": report.nodeid, "outcome": outcome})


def outcomes(path: str) -> dict[str, str]:
    """Each test of a log by node id: ``passed``, ``failed``, ``skipped``, ``error``, or
    ``not run``; a later, worse outcome (an error in teardown) wins."""
    rank = {"not run": 0, "passed": 1, "skipped": 1, "failed": 2, "error": 3}
    found: dict[str, str] = {}
    with open(path) as log:
        for line in log:
            record = json.loads(line)
            outcome = record.get("outcome", "not run")
            old = found.get(record["test"], "not run")
            found[record["test"]] = outcome if rank[outcome] >= rank[old] else old
    return found
