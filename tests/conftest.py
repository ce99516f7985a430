"""Test-session checks shared by every test file."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron-lm"


def pytest_sessionstart(session):
    # megatron-core 0.19.2 imports triton (a GPU package) and typing.override (Python 3.12) at import time; the
    # suite reads megatron objects in-process (pickled checkpoint metadata, enums), so install the stand-ins
    # once for the whole session, as every entry point does (they change nothing where triton exists).
    from megatron_ucp.megatron_lm import cpu_shims

    cpu_shims.install_import_patches()
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
