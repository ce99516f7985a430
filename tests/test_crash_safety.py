"""`kill -9` of `to-universal` and `from-universal` at named points of the write, each reached by an event
(the writer announces the phase on a fifo and waits: staging.PAUSE_ENV), then a rerun into the same DST.

After every kill before publication: DST does not exist, the killed run's staging directory is the only
leftover and no reader accepts it (even once its completion marker is written); the rerun reports it
(name, size, `--clean-stale`), and with `--clean-stale` removes it and publishes a complete output. A kill
after an `--overwrite` swap leaves the new output in place. Inputs: Megatron-LM's fixture C (legacy torch,
TP2 PP2, gpt2-like) and its universal conversion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ucp.convert import to_universal
from megatron_ucp.universal import UniversalCheckpoint, UniversalFormatError
from writer_cli import C_FIXTURE, Paused, assert_ok, assert_one_line_error, cli, leftovers, tree_digest

TO_UNIVERSAL_PHASES = ["staged", "half-written", "fsynced", "marker-written", "renaming"]
FROM_UNIVERSAL_PHASES = ["half-written", "marker-written", "renaming"]  # "staged" is the writers' shared code
# 4 rank files, written one after another in the command's own thread (--workers 1): "half-written" is then
# exactly 2 of them (with writer threads the others go on while the main thread is stopped at the phase)
FROM = ("-t", "2", "-p", "2", "--ckpt-format", "torch", "--rng-state", "cpu", "--quiet", "--workers", "1")


@pytest.fixture(scope="module")
def ucp(tmp_path_factory) -> Path:
    return to_universal(C_FIXTURE, tmp_path_factory.mktemp("crash") / "ucp", iteration=4, progress=False)


def killed_at(tmp_path: Path, phase: str, *args) -> Path:
    """Run the command, kill -9 it at `phase`; the staging directory it left."""
    run = Paused(tmp_path, phase, *args)
    run.wait()
    run.kill()
    dst = Path(args[2])
    assert not dst.exists(), f"killed at {phase}, yet {dst} exists"
    [left] = [n for n in leftovers(dst) if ".partial-" in n]
    return dst.parent / left


def assert_reader_refuses(staging: Path, cli_too: bool) -> None:
    with pytest.raises(UniversalFormatError, match="is the staging directory of a megatron-ucp write"):
        UniversalCheckpoint.open(staging)
    for command in ("inspect", "check") if cli_too else ():
        assert_one_line_error(cli(command, staging), "is the staging directory of a megatron-ucp write",
                              "not a checkpoint, whatever it holds")


def assert_rerun_cleans_and_publishes(proc, staging: Path, dst: Path) -> None:
    assert_ok(proc)
    notes = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(notes) == 1 and f"removed 1 leftover(s) of interrupted megatron-ucp writes" in notes[0], proc.stderr
    assert staging.name in notes[0] and "unfinished output" in notes[0]
    assert not staging.exists() and leftovers(dst) == []


@pytest.mark.parametrize("phase", TO_UNIVERSAL_PHASES)
def test_to_universal_killed_then_rerun(phase, tmp_path):
    dst = tmp_path / "ucp"
    source = tree_digest(C_FIXTURE)
    staging = killed_at(tmp_path, phase, "to-universal", C_FIXTURE, dst, "--iteration", "4", "--workers", "1",
                        "--quiet")
    assert (staging / "COMPLETE").exists() == (phase in ("marker-written", "renaming"))
    assert_reader_refuses(staging, cli_too=phase == "marker-written")  # even with its marker
    assert_rerun_cleans_and_publishes(cli("to-universal", C_FIXTURE, dst, "--iteration", "4", "--clean-stale",
                                          "--quiet"), staging, dst)
    assert_ok(cli("check", dst))
    assert tree_digest(C_FIXTURE) == source


def test_a_rerun_without_clean_stale_reports_and_keeps_the_leftover(tmp_path):
    dst = tmp_path / "ucp"
    staging = killed_at(tmp_path, "marker-written", "to-universal", C_FIXTURE, dst, "--iteration", "4", "--quiet")
    size_mib = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file()) / 2 ** 20
    proc = cli("to-universal", C_FIXTURE, dst, "--iteration", "4", "--quiet")
    assert_ok(proc)
    [note] = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert f"1 leftover(s) of interrupted megatron-ucp writes hold {size_mib:.1f} MiB" in note
    assert staging.name in note and note.endswith("pass --clean-stale to remove them")
    assert staging.exists() and UniversalCheckpoint.open(dst).iteration == 4
    proc = cli("to-universal", C_FIXTURE, dst, "--iteration", "4", "--overwrite", "--clean-stale", "--quiet")
    assert_rerun_cleans_and_publishes(proc, staging, dst)


def test_to_universal_killed_after_an_overwrite_swap_keeps_the_new_output(ucp, tmp_path):
    """--overwrite of a lazy checkpoint by a copied one, killed right after the two were swapped: DST is
    already the new, complete checkpoint; the old one waits under the staging name for the next run."""
    dst = to_universal(C_FIXTURE, tmp_path / "ucp", iteration=4, lazy=True, progress=False)
    run = Paused(tmp_path, "replaced", "to-universal", C_FIXTURE, dst, "--iteration", "4", "--overwrite", "--quiet")
    run.wait()
    run.kill()
    assert UniversalCheckpoint.open(dst).lazy_source is None  # the new, copied checkpoint
    assert_ok(cli("check", dst))
    [left] = [n for n in leftovers(dst) if ".partial-" in n]
    assert json.loads((dst.parent / left / "metadata.json").read_text())["lazy"]  # the replaced, lazy one


@pytest.mark.parametrize("phase", FROM_UNIVERSAL_PHASES)
def test_from_universal_killed_then_rerun(phase, ucp, tmp_path):
    dst = tmp_path / "megatron"
    before = tree_digest(ucp)
    staging = killed_at(tmp_path, phase, "from-universal", ucp, dst, *FROM)
    assert (staging / "megatron-ucp.json").exists() == (phase in ("marker-written", "renaming"))
    if phase == "half-written":  # 2 of the 4 rank files are written
        assert len(list(staging.rglob("model_optim_rng.pt"))) == 2
    if phase == "marker-written":  # a Megatron checkpoint with every file and the marker, still refused
        assert_one_line_error(cli("inspect", staging), "is the staging directory of a megatron-ucp write")
    assert_rerun_cleans_and_publishes(cli("from-universal", ucp, dst, *FROM, "--clean-stale"), staging, dst)
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert len(list(dst.rglob("model_optim_rng.pt"))) == 4
    assert json.loads((dst / "megatron-ucp.json").read_text())["kind"] == "megatron"
    assert tree_digest(ucp) == before
