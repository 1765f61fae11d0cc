"""A pytest plugin for `gpu_suite.py`'s tests part: each test's start and each phase's outcome, appended as JSON
lines to the file `GPU_SUITE_OUTCOMES` names, as they happen. pytest writes its JUnit report only when the session
ends, so a run stopped at `--limit` (a hang, a slow GPU) would bring back no outcome at all; with this, it keeps those
of the tests that ended and names the ones still running. Under xdist the controller alone writes (the workers'
reports reach it)."""

from __future__ import annotations

import json
import os

OUTCOMES = "GPU_SUITE_OUTCOMES"


def _write(config, **line) -> None:
    path = os.environ.get(OUTCOMES)
    if path and not hasattr(config, "workerinput"):  # an xdist worker: its controller writes
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_configure(config) -> None:
    global _CONFIG
    _CONFIG = config


def pytest_runtest_logstart(nodeid, location) -> None:
    _write(_CONFIG, test=nodeid, when="start")


def pytest_runtest_logreport(report) -> None:
    # What the test recorded (`record_property`: the graph pool's bytes, ...) goes along: the JUnit report that also
    # holds it is lost with a stopped run. As text, as JUnit writes it (any value serialises).
    properties = {name: str(value) for name, value in report.user_properties} if report.when == "call" else {}
    _write(
        _CONFIG,
        test=report.nodeid,
        when=report.when,
        outcome=report.outcome,
        **({"properties": properties} if properties else {}),
    )


def read_outcomes(path) -> tuple[dict[str, str], dict[str, str]]:
    """`{test: outcome}` from the lines written: "passed", "failure" (the test failed), "error" (its setup or
    teardown failed), "skipped", or "running" (started, never ended: what a stop at --limit interrupted). Names as
    the JUnit report gives them: `<file stem>::<test>`. And `{test::property: value}`, what the tests recorded, as
    the JUnit report gives it (values as text)."""
    outcomes: dict[str, str] = {}
    properties: dict[str, str] = {}
    with open(path) as f:
        for text in f:
            if not text.endswith("\n"):  # a line cut off by the stop
                break
            line = json.loads(text)
            file, _, test = line["test"].partition("::")
            name = f"{os.path.splitext(os.path.basename(file))[0]}::{test}"
            when, outcome = line["when"], line.get("outcome")
            properties.update({f"{name}::{key}": value for key, value in line.get("properties", {}).items()})
            if when == "start":
                outcomes[name] = "running"
            elif outcome == "failed":
                outcomes[name] = "failure" if when == "call" else "error"
            elif outcome == "skipped":
                outcomes[name] = "skipped"
            elif when == "call":  # passed (a setup or teardown that passed changes nothing)
                outcomes[name] = "passed"
    return outcomes, properties
