"""The real-vLLM tier: every test here is marked `vllm` (and runs in the default run). Where
real vLLM is missing the tests skip, except in CI, where a skip fails the run (tests/conftest.py):
scripts/setup-vllm, which `make test` runs first, installs it."""

from __future__ import annotations

import pytest

from tests.vllm.servers import real_vllm_missing


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/vllm/" in str(item.path):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def real_vllm() -> None:
    reason = real_vllm_missing()
    if reason is not None:
        pytest.skip(reason)
