"""megatron-core 0.13-0.15: what these releases save is read, and what they can load is written (or refused).

Sources: tests/fixtures/megatron-core-0.14, real Megatron-LM runs on CPU (cmd.txt, train.log; README.md lists the
format facts): one model (3 layers, hidden 48, GQA, SwiGLU, RMSNorm, vocab 511 + EOD, TP2 PP1 DP2, SP, distributed
optimizer, seed 1234) trained 8 iterations by core_v0.14.0 and saved as
- A14: torch_dist, fully_sharded_model_space (0.14's default; iterations 4 and 8);
- B14: legacy `torch` with distrib_optim.pt (iteration 4);
- C14: torch_dist, dp_zero_gather_scatter (--no-ckpt-fully-parallel-save; iteration 4);
- E15: core_v0.15.3 with --dist-ckpt-save-pre-mcore-014 (fully_sharded_model_space; iteration 4);
- M14: GPT-MoE (4 experts, top-2, EP2 ETP1 of the same TP2 DP2; chained dense + expert optimizers, both
  fully_sharded_model_space; iteration 4).

What is checked (tolerance atol 0 everywhere):
- A14, B14 and C14 (three formats of one run) convert to equal universal checkpoints, and equal E15 (0.15.3,
  same seed and flags: the same numbers); A14's fc1 of layer 1 is split between the two DP ranks (ranges [0, 256) and
  [256, 3072) of a TP shard), so the flattened-range assembly is exercised, not only whole shards;
- negative controls: one flipped byte in that split chunk is a difference `verify` reports at that parameter;
  a shortened range in .metadata is refused with one line; a pickle payload in that chunk never runs;
  fully_sharded_bucket_space (never chosen by Megatron-LM) is refused with what to do;
- the release is detected from the args (0.13-0.14's two arguments that 0.15 removed; 0.15's two new ones)
  and shown by inspect; removing or adding a marker changes the answer;
- GPT-MoE (M14): the dense and expert optimizers' state converts; its 0.14 write matches Megatron-LM's keys;
- from-universal `--megatron-core-version 0.14`: torch_dist is written as fully_sharded_model_space (0.14's
  DistributedOptimizer loads neither dp_reshardable nor fully_reshardable; asking for those is refused in one
  line naming 0.15; the 0.16.1 harness refuses it), with Megatron-LM's keys, shapes and mcore_data, equal to
  A14; legacy torch equals B14. These writes (and M14's) resumed in real Megatron-LM core_v0.14.0 reproduce
  train.log (fixture README; not a test: it needs Megatron-LM's source tree and minutes of CPU);
- torch_dist for 0.16 at another layout equals A14 (verify across releases), and `plan` reads A14.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain_runs import REPO
from test_bad_inputs_readers import RUN_CODE, overwrite, payload_archive

from megatron_ucp.formats.pickles import MEGATRON
from megatron_ucp.commands.from_universal import from_universal
from megatron_ucp.commands.verify import verify
from megatron_ucp.convert import to_universal
from megatron_ucp.core import versions
from megatron_ucp.serialization import safe_pickle as sp
from megatron_ucp.serialization.records import stored_tensor
from megatron_ucp.formats.common import CheckpointFormatError
from megatron_ucp.formats.torch_dist.reader import TorchDistCheckpoint
from megatron_ucp.io.byteio import FileHandles, read_stored

F14 = REPO / "tests" / "fixtures" / "megatron-core-0.14"
A14 = F14 / "A14_llama_tp2pp1dp2_distopt_sp_torch_dist" / "ckpt"
B14 = F14 / "B14_llama_tp2pp1dp2_distopt_sp_torch" / "ckpt"
C14 = F14 / "C14_llama_tp2pp1dp2_distopt_sp_torch_dist_dpzero" / "ckpt"
E15 = F14 / "E15_llama_tp2pp1dp2_distopt_sp_torch_dist_pre014" / "ckpt"
M14 = F14 / "M14_moe4top2_tp2pp1dp2ep2etp1_distopt_sp_torch_dist" / "ckpt"
ITER = "iter_0000004"
# the TP shard of layer 1's fc1 (the "up" half of TP rank 0: fragment 2 of 4 on dim 0) split between DP ranks
SPLIT_KEY = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
SPLIT_CHUNK = (1, 2, 0, 256)


def cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ucp.cli", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def copy_iteration(src: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(src / ITER, root / ITER)
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    return root


@pytest.fixture(scope="module")
def ucp14(tmp_path_factory) -> dict:
    """Universal checkpoints of A14, B14, C14 and E15 at iteration 4 (converted once)."""
    work = tmp_path_factory.mktemp("ucp14")
    return {name: to_universal(src, work / name, iteration=4, progress=False)
            for name, src in (("A14", A14), ("B14", B14), ("C14", C14), ("E15", E15))}


# --------------------------------------------------------------------------------------------------
# Reading


def test_model_space_and_legacy_saves_convert_equal(ucp14):
    """fully_sharded_model_space (0.14 and 0.15.3), dp_zero_gather_scatter and the legacy save of one run: equal
    at atol 0, Adam included."""
    reader = TorchDistCheckpoint(A14 / ITER, 4)
    assert reader.distrib_optim_sharding == "fully_sharded_model_space"
    assert SPLIT_CHUNK in reader._saved_chunks(SPLIT_KEY)  # a TP shard really is split between DP ranks
    assert TorchDistCheckpoint(C14 / ITER, 4).distrib_optim_sharding == "dp_zero_gather_scatter"
    for other in ("B14", "C14", "E15"):
        result = verify(ucp14["A14"], ucp14[other], progress=False)
        assert result.equal and result.compared_keys == ("fp32", "exp_avg", "exp_avg_sq", "step"), other
        assert len(result.diffs) == 4 * 21
    # the Megatron checkpoints themselves, read directly (not through the universal ones)
    assert verify(A14, B14, iteration_a=4, iteration_b=4, progress=False).equal
    # the byte path (locate: file regions, no tensor read) gives read()'s values on the split shard
    ref = next(r for r in reader.shards() if r.local_name == "decoder.layers.1.mlp.linear_fc1.weight" and r.tp_rank == 0)
    located, values = reader.locate(ref), reader.read(ref)
    assert len(located["exp_avg"].regions) == 3  # the gate fragment whole, the up fragment in two DP ranges
    with FileHandles() as files:
        for name in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(read_stored(files, located[name]), values[name]), name


def test_flipped_byte_in_a_split_range_is_a_difference(tmp_path, ucp14):
    """Negative control: one byte of the second DP range of the split shard changed -> verify names exactly it."""
    root = copy_iteration(A14, tmp_path)
    md = sp.load_dcp_metadata(root / ITER, MEGATRON)
    data = stored_tensor(sp.load_dcp_item(md, sp.DcpIndex(SPLIT_KEY, SPLIT_CHUNK)))
    with open(data.regions[0].path, "r+b") as f:
        at = data.regions[0].offset + 4 * 100 + 3  # the high byte of element 256 + 100 of that TP shard
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    result = verify(root, ucp14["B14"], progress=False)
    differing = [(d.name, d.key, d.num_differing) for d in result.diffs if not d.equal]
    assert differing == [("decoder.layers.1.mlp.linear_fc1.weight", "exp_avg", 1)]


def test_shortened_range_is_refused(tmp_path):
    """A DP rank's range shortened in .metadata leaves a gap: refused at open, in one line naming the tensor."""
    root = copy_iteration(A14, tmp_path)
    meta = root / ITER / ".metadata"
    metadata = pickle.loads(meta.read_bytes())  # our own copy of a fixture: torch's classes, trusted here
    chunks = metadata.state_dict_metadata[SPLIT_KEY].chunks
    i = next(i for i, c in enumerate(chunks) if tuple(c.offsets) == SPLIT_CHUNK)
    chunks[i] = type(chunks[i])(offsets=chunks[i].offsets, sizes=type(chunks[i].sizes)((1, 1, 1, 2000)))
    meta.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointFormatError, match=r"flattened ranges of fragment \(1, 2, 0\) cover "
                                                    r"\[\(0, 256\), \(256, 2256\)\], not \[0, 3072\) exactly once"):
        TorchDistCheckpoint(root / ITER, 4)
    line = one_line_error(cli("to-universal", "--quiet", root, tmp_path / "out"))
    assert SPLIT_KEY in line and "re-copy the iteration folder" in line
    assert not (tmp_path / "out").exists()


def test_payload_in_a_flattened_range_never_runs(tmp_path):
    """The flattened-range items are read through the same allow-list: a crafted pickle is refused, never run."""
    root = copy_iteration(A14, tmp_path)
    marker = tmp_path / "ran"
    item = sp.load_dcp_metadata(root / ITER, MEGATRON).storage_data[sp.DcpIndex(SPLIT_KEY, SPLIT_CHUNK)]
    overwrite(Path(item.path), item.offset, payload_archive(marker, item.length))
    line = one_line_error(cli("to-universal", "--quiet", root, tmp_path / "out"))
    assert all(s in line for s in RUN_CODE) and not marker.exists()


def test_unread_sharding_type_is_refused(tmp_path):
    """fully_sharded_bucket_space (megatron-core <= 0.14 can load it, Megatron-LM never saves it) is refused with
    its cause and what to do."""
    root = copy_iteration(A14, tmp_path)
    common_file = root / ITER / "common.pt"
    common = torch.load(common_file, weights_only=False)  # our own copy of a fixture, trusted here
    common["content_metadata"]["distrib_optim_sharding_type"] = "fully_sharded_bucket_space"
    torch.save(common, common_file)
    line = one_line_error(cli("inspect", root))
    assert "distrib_optim_sharding_type='fully_sharded_bucket_space'" in line and str(common_file) in line
    assert "load it with megatron-core 0.14" in line and "--ckpt-format torch" in line


# --------------------------------------------------------------------------------------------------
# Detection


def test_inspect_names_the_release():
    for root, label in ((A14, "0.14 or older (0.13-0.14 save alike)"), (B14, "0.14 or older (0.13-0.14 save alike)"),
                        (E15, "0.15")):
        proc = cli("inspect", root, "--iteration", "4")
        assert proc.returncode == 0, proc.stderr
        assert f"written by megatron-core {label}" in proc.stdout, root
    assert "vocab 512 padded to 512" in cli("inspect", A14).stdout  # 0.14's NullTokenizer appends EOD to 511


def test_detection_negative_control():
    """The markers decide: 0.14's two arguments that 0.15 removed, 0.15's two new ones. 0.14's args less one of
    its markers read as 0.16 (args without markers: megatron-ucp's own 0.16.1 harness); 0.14's args with 0.15's
    markers as 0.15; 0.15's args less one marker as 0.16."""
    args14 = TorchDistCheckpoint(A14 / ITER, 4).args
    args15 = TorchDistCheckpoint(E15 / ITER, 4).args
    assert versions.detect(args14).name == "0.14" and versions.detect(args15).name == "0.15"
    m14, m15 = versions.release("0.14").markers, versions.release("0.15").markers
    assert not any(m in args15 for m in m14 + versions.release("0.16").markers)
    assert versions.detect({k: v for k, v in args14.items() if k != m14[0]}).name == "0.16"
    assert versions.detect({**args14, **{m: False for m in m15}}).name == "0.15"
    assert versions.detect({k: v for k, v in args15.items() if k != m15[0]}).name == "0.16"


# --------------------------------------------------------------------------------------------------
# Writing for these releases, and across releases


def same_layout_as_megatron(ours: Path, theirs: Path) -> None:
    """Two torch_dist saves with the same keys (objects too: RNG, extra states), global shapes and (flattened
    keys) mcore_data."""
    mine, megatron = (pickle.loads((root / ITER / ".metadata").read_bytes()) for root in (ours, theirs))
    assert sorted(mine.state_dict_metadata) == sorted(megatron.state_dict_metadata)
    shapes = {k: tuple(v.size) for k, v in megatron.state_dict_metadata.items() if hasattr(v, "size")}
    assert {k: tuple(v.size) for k, v in mine.state_dict_metadata.items() if hasattr(v, "size")} == shapes
    assert mine.mcore_data == {k: v for k, v in megatron.mcore_data.items() if v}


def test_moe_chained_model_space(tmp_path):
    """GPT-MoE at EP2 ETP1: the dense and the expert optimizer's fully_sharded_model_space state (experts on their
    global axis) convert; written back for 0.14 it has Megatron-LM's keys, shapes and mcore_data and equals the
    source (Megatron-LM 0.14 resumes that write with its own losses: fixture README)."""
    ucp = to_universal(M14, tmp_path / "ucp", iteration=4, progress=False)
    from_universal(ucp, tmp_path / "td", tensor_model_parallel_size=2, data_parallel_size=2,
                   expert_model_parallel_size=2, expert_tensor_parallel_size=1, use_distributed_optimizer=True,
                   sequence_parallel=True, ckpt_format="torch_dist", megatron_core_version="0.14", progress=False)
    same_layout_as_megatron(tmp_path / "td", M14)
    result = verify(tmp_path / "td", M14, iteration_b=4, progress=False)
    assert result.equal and len(result.diffs) == 4 * 42


def test_from_universal_for_014(tmp_path, ucp14):
    """For 0.14 (which loads neither dp_reshardable nor fully_reshardable) torch_dist is written as
    fully_sharded_model_space by default: Megatron-LM's keys, global shapes and mcore_data, each TP shard saved
    whole (any DP split loads from it), equal to A14; dp_reshardable for 0.14 is refused in one line naming
    0.15. Legacy files (the same as 0.16's) are written and equal B14."""
    from_universal(ucp14["A14"], tmp_path / "td", tensor_model_parallel_size=2, data_parallel_size=2,
                   use_distributed_optimizer=True, sequence_parallel=True, ckpt_format="torch_dist",
                   megatron_core_version="0.14", progress=False)
    same_layout_as_megatron(tmp_path / "td", A14)
    assert TorchDistCheckpoint(tmp_path / "td" / ITER, 4).distrib_optim_sharding == "fully_sharded_model_space"
    assert verify(tmp_path / "td", A14, iteration_b=4, progress=False).equal
    line = one_line_error(cli("from-universal", ucp14["A14"], tmp_path / "dp", "-t", "2", "-d", "2",
                              "--use-distributed-optimizer", "--sequence-parallel", "--ckpt-format", "torch_dist",
                              "--optimizer-format", "dp_reshardable", "--quiet", "--megatron-core-version", "0.14"))
    assert "megatron-core 0.14 cannot load" in line and "--megatron-core-version 0.15" in line
    assert "--optimizer-format fully_sharded_model_space" in line and not (tmp_path / "dp").exists()
    line = one_line_error(cli("from-universal", ucp14["A14"], tmp_path / "h", "-t", "2", "-d", "2",
                              "--use-distributed-optimizer", "--sequence-parallel", "--ckpt-format", "torch_dist",
                              "--via-megatron-lm", "--optimizer-format", "fully_sharded_model_space", "--quiet"))
    assert "Megatron-LM 0.19 saves dp_reshardable or fully_reshardable" in line
    from_universal(ucp14["A14"], tmp_path / "legacy", tensor_model_parallel_size=2, data_parallel_size=2,
                   use_distributed_optimizer=True, sequence_parallel=True, ckpt_format="torch",
                   megatron_core_version="0.14", progress=False)
    assert verify(tmp_path / "legacy", B14, iteration_b=4, progress=False).equal


def test_verify_and_plan_across_releases(tmp_path, ucp14):
    """A14 (0.14, fully_sharded_model_space) against a 0.16 torch_dist write at TP1 DP4: equal at atol 0;
    `plan` reads the 0.14 checkpoint for another layout."""
    from_universal(ucp14["A14"], tmp_path / "v16", tensor_model_parallel_size=1, data_parallel_size=4,
                   use_distributed_optimizer=True, ckpt_format="torch_dist", megatron_core_version="0.16",
                   progress=False)
    assert verify(A14, tmp_path / "v16", iteration_a=4, progress=False).equal
    proc = cli("plan", A14, "--iteration", "4", "-t", "1", "-d", "4", "--use-distributed-optimizer")
    assert proc.returncode == 0, proc.stderr
