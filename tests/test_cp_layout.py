"""Context parallelism in ParallelLayout (core/layout.py, the one home of rank geometry), against megatron-core's own
rank generator, and in what the layout decides for checkpoints. Pure: no training (the runs are in
tests/test_context_parallel.py).

- global_rank / coordinates / data_coordinates and expert_global_rank / expert_coordinates equal the groups
  megatron-core 0.19.2's RankGenerator makes for order tp-cp-ep-dp-pp (dense) and tp-ep-dp-pp (experts, with
  expert-DP = TP x CP x DP / (ETP x EP)): the TP, CP, DP x CP, PP, EP, expert-TP and expert-DP groups, every layout
  of up to 16 ranks (CP 1-4);
- the distributed optimizer's shard group is DP x CP: megatron-core's bucket padding (lcm(DP x CP, 128)) and
  default bucket size (max(40M, 1M x DP x CP)) follow the layout's CP, never the args';
- the layout reads context_parallel_size from the args as Megatron-LM writes them (data_parallel_size excludes
  CP), and a sequence that 2 x CP does not divide is refused in one line.
"""

from __future__ import annotations

import itertools

import pytest

from megatron_ucp.core.layout import LayoutError, ParallelLayout
from megatron_ucp.formats.bucket_layout import DDPBucketConfig
from megatron_ucp.formats.common import layout_from_args


def _layouts(limit: int = 16):
    for tp, pp, cp, dp in itertools.product((1, 2), (1, 2), (1, 2, 3, 4), (1, 2, 3)):
        if tp * pp * cp * dp > limit:
            continue
        for ep, etp in itertools.product((1, 2, 3, 4), (1, 2)):
            try:
                yield ParallelLayout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp if etp != tp else None)
            except LayoutError:
                continue


LAYOUTS = list(_layouts())


def _groups(layout: ParallelLayout, key) -> set:
    out: dict = {}
    for rank in range(layout.world_size):
        out.setdefault(key(rank), []).append(rank)
    return {tuple(g) for g in out.values()}


def test_the_layouts_cover_cp_and_experts_carved_out_of_cp():
    assert len(LAYOUTS) > 100 and any(l.cp > 1 and l.ep > 1 and l.dp == 1 for l in LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_rank_geometry_is_megatron_cores(layout):
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    experts = RankGenerator(tp=layout.expert_tp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1,
                            order="tp-ep-dp-pp")

    def coords(rank):
        tp, dp_cp, pp = layout.coordinates(rank)
        dp, cp = layout.data_coordinates(dp_cp)
        assert layout.global_rank(tp, pp, layout.dp_cp_rank(dp, cp)) == rank
        return tp, dp, cp, pp

    mine = {
        "tp": _groups(layout, lambda r: (coords(r)[1:])),
        "cp": _groups(layout, lambda r: (coords(r)[0], coords(r)[1], coords(r)[3])),
        "dp": _groups(layout, lambda r: (coords(r)[0], coords(r)[2], coords(r)[3])),
        "dp-cp": _groups(layout, lambda r: (coords(r)[0], coords(r)[3])),
        "pp": _groups(layout, lambda r: coords(r)[:3]),
    }
    for token, groups in mine.items():
        assert groups == {tuple(g) for g in dense.get_ranks(token)}, token

    def ecoords(rank):
        found = layout.expert_coordinates(rank)
        assert layout.expert_global_rank(*found) == rank
        return found

    mine = {"tp": _groups(layout, lambda r: ecoords(r)[1:]),
            "ep": _groups(layout, lambda r: (ecoords(r)[0], *ecoords(r)[2:])),
            "dp": _groups(layout, lambda r: (*ecoords(r)[:2], ecoords(r)[3]))}
    for token, groups in mine.items():
        assert groups == {tuple(g) for g in experts.get_ranks(token)}, ("expert", token)


def test_world_size_and_shard_group():
    layout = ParallelLayout(tp=2, pp=2, cp=4, dp=1)
    assert (layout.world_size, layout.dp_cp, layout.stage_ranks) == (16, 4, 8)
    assert layout.describe() == "TP2PP2CP4DP1" and ParallelLayout.from_dict(layout.to_dict()) == layout
    assert "cp" not in ParallelLayout(tp=2).to_dict()  # layouts without CP keep their dicts
    moe = ParallelLayout(cp=2, ep=2)  # the experts carved out of the CP ranks alone
    assert (moe.expert_dp, moe.world_size) == (1, 2)
    with pytest.raises(LayoutError, match=r"TP x CP x DP = 2 ranks per pipeline stage cannot be split into ETP x "
                                          r"EP = 1 x 4"):
        ParallelLayout(cp=2, ep=4)
    with pytest.raises(LayoutError, match="cp=0 must be >= 1"):
        ParallelLayout(cp=0)


def test_the_optimizer_shards_over_dp_x_cp():
    """megatron-core's bucket padding and default bucket size use the DP x CP group's size (the layout's), whatever
    context_parallel_size the args (a source's, before a write) say."""
    args = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "context_parallel_size": 1}
    config = DDPBucketConfig.from_megatron_args(args, ParallelLayout(cp=3, dp=2), pp_rank=0, vpp_chunk=0,
                                                rank_num_parameters=1000)
    assert (config.dp_size, config.bucket_size) == (6, 40_000_000)
    config = DDPBucketConfig.from_megatron_args(args, ParallelLayout(cp=8, dp=8), pp_rank=0, vpp_chunk=0,
                                                rank_num_parameters=1000)
    assert (config.dp_size, config.bucket_size) == (64, 64_000_000)
    experts = DDPBucketConfig.from_megatron_args(args, ParallelLayout(cp=2, dp=2, ep=2), pp_rank=0, vpp_chunk=0,
                                                 rank_num_parameters=1000, experts=True)
    assert experts.dp_size == 2


def test_layout_from_megatron_lms_args():
    args = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 2,
            "data_parallel_size": 1, "world_size": 2, "num_experts": 4, "expert_model_parallel_size": 2}
    assert layout_from_args(args) == ParallelLayout(cp=2, ep=2)
    # what megatron-ucp did before CP was a dimension of the layout: CP dropped, EP2 carved out of one rank
    with pytest.raises(LayoutError):
        ParallelLayout(dp=1, ep=2)
    # args whose world size is not TP x PP x CP x DP (a data_parallel_size counting CP, as no release writes it)
    from megatron_ucp.formats.common import CheckpointFormatError

    with pytest.raises(CheckpointFormatError, match=r"args.world_size=2 is not TP x PP x CP x DP = 1 x 1 x 2 x 2"):
        layout_from_args({**args, "data_parallel_size": 2}, "common.pt")


def test_a_sequence_2cp_does_not_divide_is_refused():
    assert ParallelLayout(cp=4).sequence_problem(32) is None and ParallelLayout().sequence_problem(31) is None
    problem = ParallelLayout(cp=3).sequence_problem(32)
    assert problem == ("CP=3 splits every sequence into 2*CP = 6 equal chunks, which --seq-length 32 does not divide "
                       "into; choose a CP whose 2*CP divides 32")


# ------------------------------------------------------------------------------------------------
# The commands at CP (the fixtures trained at CP2; no training here)

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CP_FIXTURES = REPO / "tests" / "fixtures" / "megatron-core-0.19"
CPA19 = CP_FIXTURES / "CPA19_llama_tp1cp2dp2_distopt_torch_dist" / "ckpt"
CPD19 = CP_FIXTURES / "CPD19_moe_tp1cp2dp1ep2_distopt_torch_dist_fullyresh" / "ckpt"


def cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ucp.cli", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_inspect_shows_cp():
    out = cli("inspect", CPA19).stdout
    assert "layout        TP=1 PP=1 CP=2 DP=2 VPP=- SP=off EP=1   (4 ranks)" in out, out
    info = json.loads(cli("inspect", CPD19, "--json").stdout)
    assert info["layout"]["cp"] == 2 and info["layout"]["dp"] == 1 and info["layout"]["ep"] == 2


def test_experts_carved_out_of_cp_convert(tmp_path):
    """CPD19: EP2 over the two CP ranks of one DP rank. Without CP in the layout (megatron-ucp before issue 39) its
    args read as TP1 DP1 EP2 and the conversion stopped ("TP x DP = 1 x 1 ranks per pipeline stage cannot be split
    into ETP x EP = 1 x 2 expert groups"); now it converts, and its lazy index checks."""
    proc = cli("to-universal", CPD19, tmp_path / "ucp", "--quiet")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "ucp" / "metadata.json").read_text())
    assert meta["source"]["layout"]["cp"] == 2 and meta["args"]["context_parallel_size"] == 2
    assert cli("verify", tmp_path / "ucp", CPD19).returncode == 0  # the Megatron-LM files, compared at their layout
    assert cli("to-universal", CPD19, tmp_path / "lazy", "--lazy", "--quiet").returncode == 0
    assert cli("check", tmp_path / "lazy").returncode == 0


def test_plan_at_cp(tmp_path):
    ok = cli("plan", CPA19, "-t", "2", "-c", "4", "--use-distributed-optimizer")
    assert ok.returncode == 0 and "target: TP2 PP1 CP4 DP1 with the distributed optimizer = 8 ranks" in ok.stdout \
        and "(over 4 DP x CP ranks)" in ok.stdout, ok.stdout + ok.stderr
    ranks = json.loads(cli("plan", CPA19, "-t", "1", "-c", "2", "-d", "2", "--use-distributed-optimizer",
                           "--json").stdout)["ranks"]
    assert [(r["dp_rank"], r["cp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    bad = cli("plan", CPA19, "-t", "1", "-c", "3", "--use-distributed-optimizer")
    assert bad.returncode == 1 and "incompatible: CP=3 splits every sequence into 2*CP = 6 equal chunks, which " \
                                   "--seq-length 32 does not divide into" in bad.stdout, bad.stdout


def test_from_universal_refuses_a_cp_the_sequence_cannot_take(tmp_path):
    assert cli("to-universal", CPA19, tmp_path / "ucp", "--lazy", "--quiet").returncode == 0
    proc = cli("from-universal", tmp_path / "ucp", tmp_path / "out", "-t", "1", "-c", "3", "--ckpt-format",
               "torch_dist", "--use-distributed-optimizer")
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "CP=3 splits every sequence into 2*CP = 6 equal chunks" in lines[0], proc.stderr


def test_entry_point_refuses_hybrid_cp_in_one_line():
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_scripts" / "pretrain_gpt.py"),
                           "--context-parallel-size", "2", "--hybrid-context-parallel"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2 and [line for line in proc.stderr.splitlines() if "error" in line] == [
        "error: --hybrid-context-parallel: the entry point's datasets are not packed (THD); hybrid context "
        "parallelism needs packed sequences: drop the flag (--context-parallel-size alone works)"], proc.stderr
