"""Trust, second pass (issue #21): every reader validates what `check` validates, lazy sources stay inside
their checkpoint, no folder is replaced on a marker alone. Each case runs the real CLI (the commands of a
case in one subprocess, tests/test_bad_inputs_readers.run_cli) and asserts, for every command that must
refuse: exit status 1, exactly one `error:` line naming the file, the cause and the fix, no traceback,
the inputs' bytes unchanged, and nothing valid-looking at DST (no DST, DST.partial-*, DST.old-*, lock, log).

Inputs: Megatron-LM's fixture C (legacy torch, TP2 PP2, gpt2-like, 2 MB) converted once per module (a copied
and a lazy universal checkpoint); a small synthetic MoE universal checkpoint written as a legacy EP2
checkpoint; each case damages its own copy. The metadata bombs (a 200,000-deep array, a million invented
parameters) are timed and their peak RSS measured in the refusing process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
from megatron_ucp.convert import to_universal
from megatron_ucp.formats import open_checkpoint
from megatron_ucp.commands.from_universal import from_universal
from megatron_ucp.core.layout import ParallelLayout
from megatron_ucp.core.model_config import GPTModelConfig
from megatron_ucp.universal import UniversalWriter
from test_bad_inputs_readers import Run, run_cli
from writer_cli import C_FIXTURE, REPO, assert_nothing_left, copy_of, edit_metadata, flip_bit, reseal, tree_digest

FROM = ("--ckpt-format", "torch", "--rng-state", "cpu")  # from-universal at TP1 PP1 DP1
HF = ("--model-type", "gpt2")
PARAM = "decoder.layers.1.mlp.linear_fc1.weight"  # fixture C: [192, 48], fp32, exp_avg, exp_avg_sq
MIB = 2 ** 20


@pytest.fixture(scope="module")
def ucp(tmp_path_factory) -> Path:
    return to_universal(C_FIXTURE, tmp_path_factory.mktemp("trust") / "ucp", iteration=4, progress=False)


@pytest.fixture(scope="module")
def lazy_parts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trust_lazy")
    shutil.copytree(C_FIXTURE / "iter_0000004", root / "src" / "iter_0000004")
    return root / "src" / "iter_0000004", to_universal(root / "src" / "iter_0000004", root / "lazy", lazy=True,
                                                       progress=False)


def one_line(run: Run, *needles: str) -> str:
    """exit 1, one `error:` line holding every needle, no traceback."""
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    assert run.returncode == 1, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    lines = [line for line in run.stderr.splitlines() if line.strip() and not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    message = lines[0][len("error: "):]
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def refused_everywhere(src: Path, tmp_path: Path, needles: tuple, commands=("from-universal", "export-hf"),
                       inputs: tuple = (), check_lists: bool = False) -> None:
    """Every command in `commands` refuses `src` with one line holding `needles`; inputs unchanged; no output
    (DSTs beside `src`). `check_lists`: `check --json` exits 1 and lists a problem holding every needle."""
    refused_in_one_process([(src, needles, commands, inputs, check_lists)], tmp_path)


def refused_in_one_process(cases: list[tuple], tmp_path: Path) -> None:
    """refused_everywhere for several (src, needles, commands, inputs, check_lists), every command of every case
    in one subprocess (the interpreter and torch imported once)."""
    out = ("out_meg", "out_hf", "out_ucp")
    digests = {p: tree_digest(p) for src, _, _, inputs, _ in cases for p in (src, *inputs)}
    argvs, expected = [], []
    for src, needles, commands, _, check_lists in cases:
        argv = {"from-universal": ["from-universal", str(src), str(src.parent / out[0]), *FROM],
                "export-hf": ["export-hf", str(src), str(src.parent / out[1]), *HF],
                "inspect": ["inspect", str(src)], "check": ["check", str(src)],
                "verify": ["verify", str(src), str(C_FIXTURE), "--iteration-b", "4"],
                "to-universal": ["to-universal", str(src), str(src.parent / out[2])]}
        argvs += [argv[c] for c in commands] + ([["check", str(src), "--json"]] if check_lists else [])
        expected += [(needles, False)] * len(commands) + ([(needles, True)] if check_lists else [])
    for run, (needles, listed) in zip(run_cli(argvs, tmp_path), expected):
        if listed:
            assert run.returncode == 1 and "Traceback" not in run.stderr, (run.returncode, run.stderr)
            problems = json.loads(run.stdout)["problems"]
            assert any(all(n in p for n in needles) for p in problems), (needles, problems)
        else:
            one_line(run, *needles)
    for path, digest in digests.items():
        assert tree_digest(path) == digest, f"{path} was modified"
    for src, *_ in cases:
        for name in out:
            assert_nothing_left(src.parent / name)


# --------------------------------------------------------------------------------------------------
# 1, 10: what to-universal refuses to read


def test_to_universal_refuses_a_staging_folder_holding_a_finished_looking_megatron_output(tmp_path):
    """#1: a killed from-universal's DST.partial-* (its megatron-ucp.json already written), its iteration
    folder, and a folder holding a staging owner file: never a checkpoint."""
    staging = tmp_path / "meg.partial-node1-4242-0badcafe"
    shutil.copytree(C_FIXTURE, staging)
    (staging / "megatron-ucp.json").write_text(json.dumps({"tool": "megatron-ucp", "kind": "megatron"}))
    owned = tmp_path / "plain"
    shutil.copytree(C_FIXTURE, owned)
    (owned / ".megatron-ucp-staging.json").write_text("{}")
    digests = {p: tree_digest(p) for p in (staging, owned)}
    runs = run_cli([["to-universal", str(staging), str(tmp_path / "a")],
                    ["to-universal", str(staging / "iter_0000004"), str(tmp_path / "b")],
                    ["to-universal", str(owned), str(tmp_path / "c")]], tmp_path)
    for run, where in zip(runs, (staging, staging / "iter_0000004", owned)):
        one_line(run, f"{where}: is the staging directory of a megatron-ucp write", "not a checkpoint, whatever "
                 "it holds", "--clean-stale")
    assert {p: tree_digest(p) for p in (staging, owned)} == digests
    for name in "abc":
        assert_nothing_left(tmp_path / name)


def test_to_universal_of_a_universal_checkpoint_says_so(ucp, lazy_parts, tmp_path):
    """#10: a universal checkpoint (copied or lazy) given to to-universal."""
    _, lazy = lazy_parts
    digests = {p: tree_digest(p) for p in (ucp, lazy)}
    runs = run_cli([["to-universal", str(ucp), str(tmp_path / "a")], ["to-universal", str(lazy), str(tmp_path / "b")]],
                   tmp_path)
    for run, src in zip(runs, (ucp, lazy)):
        message = one_line(run, f"{src}: is already a universal checkpoint", "use it as it is", "from-universal")
        assert "not a Megatron-LM checkpoint root" not in message
    assert {p: tree_digest(p) for p in (ucp, lazy)} == digests
    assert_nothing_left(tmp_path / "a")
    assert_nothing_left(tmp_path / "b")


# --------------------------------------------------------------------------------------------------
# 2, 3, 12: metadata that no longer matches its tensors, refused by every reader


def test_metadata_that_contradicts_its_tensors_is_refused_by_every_reader(ucp, tmp_path):
    """#2: model_config edited and resealed: a layer would be dropped (or invented) silently. Each case refused
    by from-universal, export-hf and verify in one line, listed by `check` (more parameters than the model has:
    refused at open by check too)."""
    cases = []
    for case, field, value, needle in [("num_layers 4-3", "num_layers", 3, "not in the model of its model_config"),
                                       ("num_layers 4-5", "num_layers", 5, "are missing"),
                                       ("hidden_size", "hidden_size", 64, "has shape")]:
        src = copy_of(ucp, tmp_path / case)
        edit_metadata(src, lambda meta: meta["model_config"].update({field: value}))
        fewer = value == 3
        cases.append((src, (str(src), needle, "reconvert"),
                      ("from-universal", "export-hf", "verify") + (("check",) if fewer else ()), (), not fewer))
    refused_in_one_process(cases, tmp_path)


_RUN_STATE_CASES = {
    "param_groups deleted": "optimizer.param_groups is empty or missing",
    "lr deleted": "optimizer.param_groups[1] has no lr",
    "optimizer a list": "'optimizer' is not",
    "index 99": f"{PARAM} (and 0 other parameter(s)) is in param_group.index 99, but optimizer.param_groups has 2 "
                f"group(s)",
    "index -1": "param_group.index -1",
    "rng.size 2^50": f"rng.size is {2 ** 50}",
    "rng.ranks 0": "rng.ranks is 0"}


def _edit_run_state(case: str, meta: dict) -> None:
    groups = meta["optimizer"]["param_groups"]
    if case == "param_groups deleted":
        del meta["optimizer"]["param_groups"]
    elif case == "lr deleted":
        del groups[1]["lr"]
    elif case == "optimizer a list":
        meta["optimizer"] = groups
    elif case.startswith("index"):
        meta["parameters"][PARAM]["param_group"]["index"] = int(case.split()[1])
    elif case == "rng.size 2^50":
        meta["rng"]["size"] = 2 ** 50
    else:
        meta["rng"]["ranks"] = 0


def test_optimizer_and_run_state_metadata_are_validated_by_every_reader(ucp, tmp_path):
    """#3 and #12: what from-universal would otherwise write without hyper-parameters, or `check` pass: each
    case refused by from-universal and export-hf in one line, listed by `check`."""
    cases = []
    for case, needle in _RUN_STATE_CASES.items():
        src = copy_of(ucp, tmp_path / case.replace(" ", "_").replace("^", ""))
        edit_metadata(src, lambda meta: _edit_run_state(case, meta))
        cases.append((src, (str(src / "metadata.json"), needle, "metadata.json was edited, reconvert"),
                      ("from-universal", "export-hf"), (), True))
    refused_in_one_process(cases, tmp_path)


# --------------------------------------------------------------------------------------------------
# 4: lazy sources only inside the recorded source checkpoint, of the kinds it holds, without links


def _hard_linked_source(src_iter: Path, elsewhere: Path, rename) -> None:
    """`elsewhere`: the source's files hard-linked (same bytes, size and mtime: every checksum matches) under
    names rename(rel) gives."""
    for f in sorted(p for p in src_iter.rglob("*") if p.is_file()):
        rel = str(f.relative_to(src_iter))
        target = elsewhere / rename(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(f, target)


@pytest.mark.parametrize("case", ["any file, checksums matching", "another folder", "linked rank folder"])
def test_a_lazy_index_reads_only_its_recorded_sources_data_files(case, lazy_parts, tmp_path):
    """#4: lazy.source and its regions moved to a file the checkpoint never held (every checksum matching,
    as a careful attacker makes them), to another folder, or reached through a symbolic link."""
    src_iter, lazy = lazy_parts
    ucp_dir = copy_of(lazy, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    inputs = (src_iter,)
    if case == "any file, checksums matching":
        _hard_linked_source(src_iter, elsewhere, lambda rel: rel.replace("/", "_").replace(".pt", ".txt"))

        def edit(meta):
            text = json.dumps(meta)
            for rel in meta["lazy"]["files"]:
                text = text.replace(json.dumps(rel), json.dumps(rel.replace("/", "_").replace(".pt", ".txt")))
            moved = json.loads(text)
            moved["lazy"]["source"] = moved["source"]["path"] = str(elsewhere)
            meta.clear()
            meta.update(moved)

        needles = ("the lazy index reads", str(elsewhere), "not a tensor file of a Megatron-LM checkpoint folder",
                   "reconvert")
    elif case == "another folder":
        _hard_linked_source(src_iter, elsewhere, lambda rel: rel)

        def edit(meta):
            meta["lazy"]["source"] = str(elsewhere)

        needles = (str(ucp_dir / "metadata.json"), "is not the checkpoint the conversion read", "reconvert")
    else:
        src_iter = copy_of(src_iter, tmp_path, "src_copy")
        rank = src_iter / "mp_rank_01_001"
        rank.rename(elsewhere)
        rank.symlink_to(elsewhere, target_is_directory=True)
        inputs = (src_iter, elsewhere)

        def edit(meta):
            meta["lazy"]["source"] = meta["source"]["path"] = str(src_iter)

        needles = (str(rank), "reached through a symbolic link", "reconvert")
    edit_metadata(ucp_dir, edit)
    refused_everywhere(ucp_dir, tmp_path, needles, commands=("export-hf", "from-universal", "check"),
                       inputs=inputs + ((elsewhere,) if elsewhere.exists() else ()))


# --------------------------------------------------------------------------------------------------
# 5, 6: metadata bombs, refused in seconds and hundreds of MiB


# Runs `python -m megatron_ucp.cli ARGS --quiet` once per argv given (JSON lists) in this one process, printing
# per run [exit status, stdout, stderr, seconds, the process's peak RSS so far in bytes]. VmHWM is this process's
# own peak (ru_maxrss would keep the forking test process's).
_MEASURED = r"""
import contextlib, io, json, resource, runpy, sys, time
results = []
for argv in map(json.loads, sys.argv[1:]):
    sys.argv = ["megatron-ucp", *argv, "--quiet"]
    out, err, code = io.StringIO(), io.StringIO(), 0
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("megatron_ucp.cli", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    seconds = time.perf_counter() - start
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
    kib = int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results.append([code, out.getvalue(), err.getvalue(), seconds, kib * 1024])
print(json.dumps(results))
"""


def measured(commands: list[list[str]], cwd: Path) -> list[tuple[Run, float, int]]:
    """The CLI once per argv in one process: (run, seconds in the command, the process's peak RSS after it)."""
    proc = subprocess.run([sys.executable, "-c", _MEASURED, *map(json.dumps, commands)], capture_output=True,
                          text=True, timeout=600, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO),
                                                                    OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return [(Run(code, out, err), seconds, rss) for code, out, err, seconds, rss in json.loads(proc.stdout)]


def _invented_parameters(n: int) -> str:
    """n parameters no model has, as metadata.json's `parameters` text (~130 bytes each)."""
    entry = ('{"shape":[1],"dtype":"float32","pattern":{"kind":"replicated"},"file":"tensors/u.%d.safetensors",'
             '"tensors":["fp32"]}')
    return "{" + ",".join(f'"u.{i}":' + entry % i for i in range(n)) + "}"


@pytest.mark.parametrize("bomb", ["200000-deep array", "1000000 unknown parameters"])
def test_a_metadata_bomb_is_refused_in_seconds_and_bounded_memory(bomb, ucp, tmp_path):
    """#5 and #6: metadata.json edited (and resealed) into a recursion bomb or a million invented parameters:
    check, inspect and from-universal refuse it in one line naming the file, in seconds, without the memory
    its declared size would take (the million-parameter file is refused before it is parsed)."""
    src = copy_of(ucp, tmp_path)
    meta = json.loads((src / "metadata.json").read_text())
    if bomb == "200000-deep array":
        meta["args"]["deep"] = "@DEEP@"
        text = json.dumps(meta).replace('"@DEEP@"', "[" * 200000 + "]" * 200000)
        needles = (str(src / "metadata.json"), "nested too deeply", "reconvert")
    else:
        meta["parameters"] = "@PARAMS@"
        text = json.dumps(meta).replace('"@PARAMS@"', _invented_parameters(1000000))
        needles = (str(src / "metadata.json"), "more than a checkpoint of 52 tensor files", "reconvert")
    (src / "metadata.json").write_text(text)
    reseal(src)
    size = (src / "metadata.json").stat().st_size
    before = tree_digest(src)
    report = []
    commands = [["check", str(src)], ["inspect", str(src)], ["from-universal", str(src), str(tmp_path / "out"), *FROM]]
    for argv, (run, seconds, rss) in zip(commands, measured(commands, tmp_path)):
        one_line(run, *needles)
        report.append(f"{argv[0]}: {seconds:.2f} s, {rss / MIB:.0f} MiB")
        assert seconds < 20, (argv[0], seconds)
        assert rss < 700 * MIB, (argv[0], rss / MIB)
    print(f"{bomb} ({size / MIB:.1f} MiB metadata.json): " + "; ".join(report))
    assert tree_digest(src) == before
    assert_nothing_left(tmp_path / "out")


# --------------------------------------------------------------------------------------------------
# 7, 11: counts refused before anything is created


def test_from_universal_counts_below_one_are_refused_before_anything_is_created(ucp, tmp_path):
    """#7 and #11: a zero or negative count, --via-megatron-lm --timeout -5 (no log left beside DST)."""
    dst = tmp_path / "out"
    cases = [(["--expert-model-parallel-size", "0"], "--expert-model-parallel-size 0: must be >= 1"),
             (["-t", "0"], "--tensor-model-parallel-size 0: must be >= 1"),
             (["-d", "-1"], "--data-parallel-size -1: must be >= 1"),
             (["--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size 0: must be >= 1"),
             (["--workers", "0"], "--workers 0: must be >= 1"),
             (["--via-megatron-lm", "--timeout", "-5"], "--timeout -5: must be >= 1")]
    before = tree_digest(ucp)
    runs = run_cli([["from-universal", str(ucp), str(dst), "--ckpt-format", "torch_dist", "--rng-state", "cpu",
                     *flags] for flags, _ in cases], tmp_path)
    for run, (_, needle) in zip(runs, cases):
        one_line(run, needle, "pass a positive number")
        assert "modulo" not in run.stderr
    assert tree_digest(ucp) == before
    assert_nothing_left(dst)
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


# --------------------------------------------------------------------------------------------------
# 8: plan suggests only TPs the model takes


def test_plan_suggests_only_tensor_parallel_sizes_the_whole_model_takes(tmp_path):
    """#8: fixture A (4 heads, 2 query groups, vocabulary 1024) at TP3: every suggestion is a TP that divides
    heads, query groups and FFN alike."""
    src = C_FIXTURE.parent.parent / "A_llama_tp2pp2dp2_distopt_sp_torch" / "ckpt"
    (run,) = run_cli([["plan", str(src), "-t", "3", "--json"]], tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    text = run.stdout
    assert "num_query_groups=2 is not divisible by TP=3" in text
    suggestions = [part.split("]")[0] + "]" for part in text.split("TP in ")[1:]]
    assert len(suggestions) >= 3 and set(suggestions) == {"[1, 2]"}, suggestions


# --------------------------------------------------------------------------------------------------
# 9: a damaged replica names its rank files and says to restore, not average


def _locate(src: Path, local_name: str, tp_rank: int, pp_rank: int) -> tuple[Path, int]:
    ckpt = open_checkpoint(src, iteration=4)
    ref = next(r for r in ckpt.shards() if (r.local_name, r.tp_rank, r.pp_rank) == (local_name, tp_rank, pp_rank))
    region = ckpt.locate(ref, keys=("fp32",))["fp32"].regions[0]
    return Path(region.path), region.offset


@pytest.mark.parametrize("case", ["TP replica", "tied output copy"])
def test_a_flipped_bit_in_a_replica_names_the_rank_files_and_the_fix(case, tmp_path):
    """#9: one bit of TP rank 1's final layernorm (replicated), or of the last stage's tied output_layer copy:
    refused, naming the rank files; the fix is restoring the checkpoint (averaging would keep the damage)."""
    src = copy_of(C_FIXTURE, tmp_path)
    local = "decoder.final_layernorm.weight" if case == "TP replica" else "output_layer.weight"
    file, offset = _locate(src, local, 1, 1)
    flip_bit(file, offset + 8, bit=3)
    dst = tmp_path / "out"
    before = tree_digest(src)
    (run,) = run_cli([["to-universal", str(src), str(dst), "--iteration", "4"]], tmp_path)
    if case == "TP replica":
        needles = ("decoder.final_layernorm.weight [fp32]", f"the copy on TP rank 1 ({file})",
                   f"from the one on TP rank 0 ({src / 'iter_0000004' / 'mp_rank_00_001' / 'model_optim_rng.pt'})")
    else:
        needles = ("embedding.word_embeddings.weight [fp32] (tied)", str(file),
                   "the tied output_layer copy differs from the embedding")
    message = one_line(run, *needles, "restore the checkpoint from a copy (averaging would keep the damage)")
    assert "average=True" not in message
    assert tree_digest(src) == before
    assert_nothing_left(dst)


# --------------------------------------------------------------------------------------------------
# 13: --overwrite replaces only a complete output of this tool


@pytest.mark.parametrize("case", ["copied COMPLETE", "COMPLETE and metadata.json copied", "copied megatron marker",
                                  "copied hf marker"])
def test_overwrite_never_replaces_a_folder_holding_only_a_copied_marker(case, ucp, tmp_path):
    """#13: a user's folder with a copied marker (and the files it seals, where a copy can bring them) plus
    the user's own file."""
    victim = tmp_path / "mine"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    meg = tmp_path / "meg"
    command = {"copied COMPLETE": "to-universal", "COMPLETE and metadata.json copied": "to-universal",
               "copied megatron marker": "from-universal", "copied hf marker": "export-hf"}[case]
    if command == "to-universal":
        shutil.copy(ucp / "COMPLETE", victim / "COMPLETE")
        if case == "COMPLETE and metadata.json copied":
            shutil.copy(ucp / "metadata.json", victim / "metadata.json")
        argv = ["to-universal", str(C_FIXTURE), str(victim), "--iteration", "4", "--overwrite"]
    else:
        kind = "megatron" if command == "from-universal" else "hf"
        (victim / "megatron-ucp.json").write_text(json.dumps({"tool": "megatron-ucp", "kind": kind, "entries": []}))
        argv = ([command, str(ucp), str(victim), *FROM] if kind == "megatron" else
                [command, str(ucp), str(victim), *HF]) + ["--overwrite"]
    existed = tree_digest(victim)
    (run,) = run_cli([argv], tmp_path)
    one_line(run, f"{victim}: exists and is not a complete output of megatron-ucp as it was written",
             "refusing to overwrite it", "delete it yourself or choose another destination")
    assert_nothing_left(victim, existed=existed)
    assert not meg.exists()


# --------------------------------------------------------------------------------------------------
# 14: swapped EP rank folders of a legacy MoE checkpoint


def _moe_universal(dst: Path) -> Path:
    """A small MoE (4 experts, 2 layers) universal checkpoint with random state and Megatron-like args."""
    config = GPTModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, kv_channels=8, vocab_size=256, padded_vocab_size=256,
                            max_position_embeddings=16, swiglu=True, normalization="RMSNorm",
                            position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                            add_bias_linear=False, num_experts=4, moe_ffn_hidden_size=16)
    args = {k: v for k, v in config.to_dict().items() if not k.startswith("moe_") or k == "moe_ffn_hidden_size"}
    args.update(group_query_attention=True, micro_batch_size=1, global_batch_size=8, bf16=True, seed=1234)
    with UniversalWriter(dst) as writer:
        for seed, (name, shape) in enumerate(expected_parameters(config)):
            g = torch.Generator().manual_seed(seed)
            writer.write_parameter(name, {"fp32": torch.randn(shape, generator=g),
                                          "exp_avg": torch.randn(shape, generator=g),
                                          "exp_avg_sq": torch.rand(shape, generator=g)},
                                   {"model_dtype": "bfloat16", "pattern": pattern_for(name, config), "step": 3,
                                    "param_group": {"index": int(len(shape) == 1)}})
        return writer.finish({
            "iteration": 3, "consumed_train_samples": 24, "model_config": config.to_dict(), "args": args,
            "source": {"format": "torch", "path": "/nowhere", "layout": ParallelLayout().to_dict(),
                       "optimizer_kind": "distributed"},
            "optimizer": {"type": "adam", "param_groups": [{"wd_mult": 1.0, "lr": 1e-3, "weight_decay": 0.1},
                                                           {"wd_mult": 0.0, "lr": 1e-3, "weight_decay": 0.0}]},
            "scheduler": {}}, expected_parameters(config))


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed optimizer"])
def test_swapped_ep_rank_folders_are_named_as_such(distributed, tmp_path):
    """#14: a legacy EP2 checkpoint (written by from-universal, as Megatron-LM names and fills its folders)
    with its two EP rank folders exchanged: with the distributed optimizer, EP folder 0 lacks the dense state
    (as in Megatron-LM's own files, measured on the legacy_bias source of test_moe_universal); with plain Adam,
    the saving rank the args record."""
    src = tmp_path / "legacy"
    from_universal(_moe_universal(tmp_path / "moe_ucp"), src, ckpt_format="torch", data_parallel_size=2,
                   expert_model_parallel_size=2, use_distributed_optimizer=distributed, rng_state="cpu",
                   progress=False, warn=lambda message: None)
    (src / "megatron-ucp.json").unlink()
    it = src / "iter_0000003"
    (it / "mp_rank_00_000").rename(it / "swap")
    (it / "mp_rank_00_001").rename(it / "mp_rank_00_000")
    (it / "swap").rename(it / "mp_rank_00_001")
    before = tree_digest(src)
    (run,) = run_cli([["to-universal", str(src), str(tmp_path / "out")]], tmp_path)
    needles = ((str(it / "mp_rank_00_000" / "distrib_optim.pt"), "lacks the dense optimizer's state", "EP rank 0 "
                "(this one)") if distributed else  # what Megatron-LM's own files show (their args hold no rank)
               (str(it / "mp_rank_00_000" / "model_optim_rng.pt"), "was saved by rank 1 (EP rank 1",
                "folder of EP rank 0"))
    message = one_line(run, *needles, "rank folders were swapped or renamed", "Re-copy the iteration folder")
    assert "missing or malformed" not in message
    assert tree_digest(src) == before
    assert_nothing_left(tmp_path / "out")


def test_overwrite_replaces_an_output_only_as_it_was_written(ucp, tmp_path):
    """#13, neighbour: a universal checkpoint this tool wrote, with a user's file added, is not replaced; once
    the file is gone it is (and the user's folder beside it is untouched)."""
    dst = copy_of(ucp, tmp_path, "out")
    (dst / "notes.txt").write_text("mine")
    existed = tree_digest(dst)
    argv = ["to-universal", str(C_FIXTURE), str(dst), "--iteration", "4", "--overwrite"]
    (run,) = run_cli([argv], tmp_path)
    one_line(run, f"{dst}: exists and is not a complete output of megatron-ucp as it was written",
             "refusing to overwrite it")
    assert_nothing_left(dst, existed=existed)
    (dst / "notes.txt").unlink()
    (run,) = run_cli([argv], tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"] and (dst / "COMPLETE").is_file()
