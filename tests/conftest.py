"""Test-session checks shared by every test file."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "megatron-lm"


def pytest_sessionstart(session):
    # Many tests read Megatron-LM's own checkpoints; without them the suite must fail, not skip.
    if not (FIXTURES / "LOSSES.txt").is_file():
        raise pytest.UsageError(f"Megatron-LM fixtures not found at {FIXTURES}: the repository must sit "
                                "beside ../shared/fixtures/megatron-lm (as in CI)")
