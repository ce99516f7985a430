"""Journey 2 without a conversion: `--load CKPT --universal-checkpoint`, CKPT the run's own Megatron-LM checkpoint
(issue 35). Rank 0 indexes it in memory (convert.runner.source_index), every rank reads its slices straight from
its files (megatron_lm/loader.py). Through Megatron-LM 0.19's own loop, with the fork server (tests/zygote.py).

- megatron-core 0.14 (tests/fixtures/megatron-core-0.14: A14 torch_dist fully_sharded_model_space, B14 legacy
  torch + distrib_optim.pt and C14 torch_dist dp_zero_gather_scatter, one run saved three ways at TP2 PP1 DP2 SP;
  M14 GPT-MoE at EP2 ETP1, chained dense + expert optimizers) resumed at TP1 PP1 DP2 (M14 at EP1: the experts in
  the dense optimizer): iterations 5-8 equal the resume of the fixture's to-universal conversion bit for bit
  (every --log-jsonl field: lm loss, grad norm, lr, MoE losses). Not compared with the fixtures' own train.log:
  0.14's MockGPTDataset feeds token ids beyond the vocabulary, which 0.19's wraps (fixture README), so no 0.19
  run sees 0.14's data. The 0.16.1 and 0.19 fixtures, whose data 0.19 reproduces, are compared with their own logs
  in test_fixture_continuation.py and test_megatron_lm_019.py, in the tests that resume them through to-universal.
- a damaged source (a truncated .distcp, a missing rank folder, a flipped byte in one TP copy of a replicated
  tensor, a flipped sign bit in a second moment) stops the job with one `error:` line, exit 2, before any step,
  and its folder is unchanged (hashes before and after): found at argument time by every rank (the first two),
  while rank 0 indexes it (shared with every rank), or by the rank that reads the damaged value (agreed by all);
  in the last two every rank prints the line;
- a job killed inside its first save (into the checkpoint root it loaded from, as job scripts do) leaves the
  source intact (hashes, tracker) and loadable: A14's direct resume above loads from that root afterwards.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Dict, List

import pytest

from pretrain_runs import A14, B14, C14, F14, M14, REPO, Layout, read_records, run_pretrain
from test_megatron_lm_019 import with_layout

pytestmark = pytest.mark.torchrun

ITER = "iter_0000004"
KILL_SCRIPT = REPO / "tests" / "save_killed_script.py"
LAYOUT = Layout(dp=2)  # TP1 PP1 DP2, EP1: not the fixtures' TP2 PP1 DP2 (EP2 ETP1)
# what the fixtures' command lines set that LAYOUT sets here
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
                "--expert-model-parallel-size", "--expert-tensor-parallel-size")
# 0.14's NullTokenizer appended EOD to --vocab-size 511 (vocabulary 512, EOD 511); 0.19 counts EOD inside it
V014_VOCABULARY = {"--vocab-size": "512", "--null-tokenizer-eod-id": "511"}
REFERENCE = {A14: A14, B14: A14, C14: A14, M14: M14}  # A14, B14, C14 convert equal (test_megatron_old_releases)


def fixture_flags(name: str) -> List[str]:
    """The fixture's cmd.txt flags for Megatron-LM 0.19 at LAYOUT: no --save, 0.19's spelling of its vocabulary."""
    argv = shlex.split((F14 / name / "cmd.txt").read_text().splitlines()[-1])
    flags = argv[next(i for i, a in enumerate(argv) if a.endswith("run_pretrain_mcore_old_cpu.py")) + 1:]
    out: List[str] = []
    for i, flag in enumerate(flags):  # drop LAYOUT's flags and the save, with their values
        dropped = flag in (*LAYOUT_FLAGS, "--save", "--save-interval")
        if dropped or (not flag.startswith("--") and out and out[-1] is None):
            out.append(None)
        else:
            out.append(flag)
    flags = with_layout([f for f in out if f is not None], V014_VOCABULARY)
    assert "ckpt" not in flags and "--save" not in flags
    return flags


def copy_root(name: str, dst: Path) -> Path:
    """A --save root holding the fixture's iteration 4 only (tracker 4), as a job's checkpoint folder would."""
    shutil.copytree(F14 / name / "ckpt" / ITER, dst / ITER)
    (dst / "latest_checkpointed_iteration.txt").write_text("4")
    return dst


def tree_hashes(root: Path) -> Dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def resume(flags: List[str], work: Path, label: str, load: Path, *extra: str) -> Dict[int, dict]:
    """Iterations 5-8 from `load` with --universal-checkpoint at LAYOUT; every --log-jsonl field by iteration."""
    jsonl = work / f"{label}.jsonl"
    run_pretrain(LAYOUT, [*flags, "--load", str(load), "--universal-checkpoint", *extra, "--log-jsonl", str(jsonl)],
                 work, label)
    records = read_records(jsonl)
    assert sorted(records) == [5, 6, 7, 8], f"{label}: the resume should run iterations 5-8: {sorted(records)}"
    return records


@pytest.fixture(scope="module")
def work14(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("direct14")


@pytest.fixture(scope="module")
def through_to_universal(work14) -> Dict[str, Dict[int, dict]]:
    """The reference of each kind of fixture: its to-universal conversion resumed at LAYOUT (run on first use)."""
    from megatron_ucp.convert import to_universal

    class Runs(dict):
        def __missing__(self, name):
            ucp = to_universal(F14 / name / "ckpt", work14 / f"{name}.ucp", iteration=4, progress=False)
            self[name] = resume(fixture_flags(name), work14, f"{name}.ucp", ucp)
            return self[name]

    return Runs()


@pytest.fixture(scope="module")
def killed_root(work14):
    """A14's iteration 4 as a job's --load/--save root; a direct resume at LAYOUT saving there after iteration 5,
    killed inside that save (tests/save_killed_script.py). Returns the root, its source hashes before the job and
    the killed job's log."""
    root = copy_root(A14, work14 / "job_root")
    before = tree_hashes(root)
    marker = work14 / "inside_the_save"
    outcome = {}

    def job():
        try:
            outcome["proc"] = run_pretrain(
                LAYOUT, [*fixture_flags(A14), "--load", str(root), "--universal-checkpoint", "--save", str(root),
                         "--save-interval", "1"], work14, "killed", expect_failure=True,
                env={"MEGATRON_UCP_TEST_SAVE_MARKER": str(marker)}, script=KILL_SCRIPT)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            outcome["error"] = e

    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.monotonic() + 300
    while not marker.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if marker.exists():
        time.sleep(0.2)  # the pid is written whole (a few bytes) before the rank waits
        os.kill(int(marker.read_text()), signal.SIGKILL)  # rank 0, inside the save; the launcher stops the rest
    thread.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    assert marker.exists(), f"the job never reached its save: {(work14 / 'killed.log').read_text()[-3000:]}"
    return root, before, outcome["proc"].stdout


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [A14, B14, C14, M14])
def test_014_fixture_resumed_directly_equals_the_to_universal_resume(name, work14, through_to_universal, killed_root):
    """Bit for bit: every --log-jsonl field of iterations 5-8 (A14 from the root a killed job saved into)."""
    load = killed_root[0] if name == A14 else F14 / name / "ckpt"
    direct = resume(fixture_flags(name), work14, f"{name}.direct", load)
    log = (work14 / f"{name}.direct.log").read_text()
    assert "is a Megatron-LM checkpoint" in log and "every rank reads its slices straight from its files" in log
    reference = through_to_universal[REFERENCE[name]]
    assert direct == reference, f"{name}: the direct resume differs from the to-universal one"


def test_kill_during_the_first_save_leaves_the_source_intact(killed_root):
    root, before, log = killed_root
    assert "reads its slices straight from its files" in log and "] iteration        5/" in log
    saved = root / "iter_0000005"
    assert saved.is_dir() and list(saved.glob("*.distcp")) and not (saved / ".metadata").exists()  # killed inside
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    after = tree_hashes(root)
    assert {k: v for k, v in after.items() if not k.startswith("iter_0000005")} == before


def flip(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def located(root: Path, local_name: str, tp_rank: int, key: str):
    """The first file region of a shard's `key` in the checkpoint at `root` (the reader's own map of the files)."""
    from megatron_ucp.formats import open_checkpoint

    ckpt = open_checkpoint(root)
    ref = next(r for r in ckpt.shards() if r.local_name == local_name and r.tp_rank == tp_rank)
    return ckpt.locate(ref)[key].regions[0]


def truncate_a_distcp(root: Path) -> str:
    victim = sorted((root / ITER).glob("*.distcp"))[-1]
    os.truncate(victim, victim.stat().st_size - 100)
    return f"{victim}: item "


def remove_a_rank_folder(root: Path) -> str:
    shutil.rmtree(root / ITER / "mp_rank_01")
    return f"{root / ITER / 'mp_rank_01'}: missing rank folder for tp=1 pp=0"


def flip_a_replica(root: Path) -> str:
    """One byte of TP rank 1's copy of a norm weight (replicated over TP): rank 0's index compares the copies."""
    region = located(root, "decoder.final_layernorm.weight", 1, "fp32")
    flip(Path(region.path), region.offset + 1, 0x01)
    return "decoder.final_layernorm.weight [fp32]"


def flip_a_moment_sign(root: Path) -> str:
    """The sign bit of one element of a sharded second moment: only the rank reading it sees the value."""
    region = located(root, "decoder.layers.1.mlp.linear_fc2.weight", 0, "exp_avg_sq")
    flip(Path(region.path), region.offset + 4 * 7 + 3, 0x80)  # little-endian float32: byte 3 holds the sign
    return "decoder.layers.1.mlp.linear_fc2.weight [exp_avg_sq] holds 1 negative or non-finite value(s)"


DAMAGES = [  # (fixture, damage, found by every rank alike after agreeing)
    (A14, truncate_a_distcp, False),
    (B14, remove_a_rank_folder, False),
    (B14, flip_a_replica, True),
    (A14, flip_a_moment_sign, True),
]


@pytest.mark.parametrize("name,damage,agreed", DAMAGES, ids=[d.__name__ for _, d, _ in DAMAGES])
def test_damaged_source_is_refused_before_the_first_step(name, damage, agreed, tmp_path):
    root = copy_root(name, tmp_path / "ckpt")
    expected = damage(root)
    before = tree_hashes(root)
    proc = run_pretrain(LAYOUT, [*fixture_flags(name), "--load", str(root), "--universal-checkpoint"], tmp_path,
                        "refused", expect_failure=True)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors and len(set(errors)) == 1, proc.stdout[-3000:]
    assert expected in errors[0], errors[0]
    if agreed:  # every rank said it (each waits for the others before exiting)
        assert len(errors) == LAYOUT.nproc, errors
    assert "Traceback" not in proc.stdout and "] iteration" not in proc.stdout
    assert tree_hashes(root) == before
