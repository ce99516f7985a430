"""Test-session checks shared by every test file."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron-lm"


def pytest_sessionstart(session):
    # Many tests read Megatron-LM's own checkpoints; without them the suite must fail, not skip.
    if not (FIXTURES / "LOSSES.txt").is_file():
        raise pytest.UsageError(f"Megatron-LM fixtures not found at {FIXTURES}: they are part of the "
                                "repository (tests/fixtures/megatron-lm); restore them with git checkout")


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Training runs and their universal conversions, each distinct command once per session
    (pretrain_runs.RunCache)."""
    from pretrain_runs import RunCache

    return RunCache(tmp_path_factory.mktemp("runs"))
