"""Fault-suite fixtures: one vLLM CPU server of its own (runs here train against it and change its weights), a
fault-injecting proxy per test, and the summary line (scenarios N, hangs, silent, prompts lost, trained twice),
followed by the chaos soak's audit line when it ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import start_server

from .harness import SCORE, SOAK_LINES, Hang, Silent
from .proxy import FaultProxy

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.faults)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if Path(str(item.fspath)).parent != HERE or report.when != "call":
        return
    SCORE["scenarios"] += 1
    if report.passed:
        SCORE["passed"] += 1
    elif call.excinfo is not None and call.excinfo.errisinstance(Hang):
        SCORE["hangs"] += 1
    elif call.excinfo is not None and call.excinfo.errisinstance(Silent):
        SCORE["silent"] += 1


def pytest_terminal_summary(terminalreporter):
    if SCORE["scenarios"]:
        terminalreporter.write_line(
            f"fault suite: scenarios {SCORE['scenarios']} (passed {SCORE['passed']}), hangs {SCORE['hangs']}, "
            f"silent {SCORE['silent']}, prompts lost {SCORE['lost']}, trained twice {SCORE['twice']}")
    for line in SOAK_LINES:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def faults_server(tiny_qwen3, tmp_path_factory):
    server = start_server(tiny_qwen3, tmp_path_factory.mktemp("faults_vllm"))
    yield server
    server.stop()


@pytest.fixture
def proxy(faults_server):
    p = FaultProxy(faults_server.base_url)
    yield p
    p.close()
