"""The optimizer's state by name (core/optimizers.py, docs/FORMAT.md "Optimizer state by name"), without training:
a synthetic SGD universal checkpoint round-trips (version 4, its states declared, Adam checkpoints unchanged), state
names from a checkpoint are checked before they name anything, Lion's and Muon's parameters take the rows megatron-core
0.19 gives them (the emerging optimizer on the matrices, its scalar optimizer on the rest), and every optimizer
megatron-ucp does not map (dist_muon's raw name, SOAP, adaptive Muon, the layer-wise distributed optimizer outside
torch_dist's dp_reshardable saves, SGD under the distributed optimizer, a scalar optimizer megatron-core does not build) is refused in one line naming it, at conversion
time (the readers' optimizer_row) and at argument time (the loader).
"""

import hashlib
import json
import shutil

import pytest
import torch

from megatron_ucp.adapters.gpt import expected_parameters, pattern_for
from megatron_ucp.core import optimizers
from megatron_ucp.formats.common import CheckpointFormatError, optimizer_row
from megatron_ucp.universal import COMPLETE_FILENAME, METADATA_FILENAME, UniversalCheckpoint, UniversalFormatError
from megatron_ucp.universal import UniversalWriter
from megatron_ucp.universal.format import optimizer_section

from test_universal_format import CONFIG, metadata, write_all


def write_sgd(dst, momentum_key="momentum_buffer"):
    written = {}
    meta = metadata()
    meta["optimizer"] = optimizer_section("sgd", [{"lr": 1e-2, "weight_decay": 0.1, "momentum": 0.9},
                                                  {"lr": 1e-2, "weight_decay": 0.0, "momentum": 0.9}])
    with UniversalWriter(dst) as writer:
        for seed, (name, shape) in enumerate(expected_parameters(CONFIG)):
            g = torch.Generator().manual_seed(seed)
            written[name] = {"fp32": torch.randn(shape, generator=g), momentum_key: torch.randn(shape, generator=g)}
            writer.write_parameter(name, written[name], {
                "model_dtype": torch.float32, "pattern": pattern_for(name, CONFIG), "step": None,
                "param_group": {"index": int(len(shape) == 1), "wd_mult": 0.0 if len(shape) == 1 else 1.0}})
        path = writer.finish(meta, expected_parameters(CONFIG))
    return path, written


def reseal(path):
    """The COMPLETE marker made consistent with an edited metadata.json (an edit, not damage)."""
    marker = json.loads((path / COMPLETE_FILENAME).read_text())
    marker["metadata_sha256"] = hashlib.sha256((path / METADATA_FILENAME).read_bytes()).hexdigest()
    (path / COMPLETE_FILENAME).write_text(json.dumps(marker))


def test_sgd_round_trip_is_version_4_and_adam_stays_as_it_was(tmp_path):
    path, written = write_sgd(tmp_path / "sgd")
    ucp = UniversalCheckpoint.open(path)
    assert ucp.version == 4 and ucp.optimizer_type == "sgd" and ucp.has_optimizer_state
    assert ucp.optimizer_state_keys == ("momentum_buffer",)
    assert ucp.metadata["optimizer"]["states"] == {"momentum_buffer": "elementwise"}
    for name, tensors in written.items():
        assert ucp.parameters[name].tensors == ("fp32", "momentum_buffer") and ucp.parameters[name].step is None
        assert torch.equal(ucp.read(name, "momentum_buffer"), tensors["momentum_buffer"])
    adam, _ = write_all(tmp_path / "adam")
    meta = json.loads((adam / METADATA_FILENAME).read_text())
    assert meta["version"] == 2 and "states" not in meta["optimizer"]  # written exactly as before
    assert UniversalCheckpoint.open(adam).optimizer_state_keys == ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("edit, why", [
    (lambda m: m["optimizer"].update(states={"../../etc/passwd": "elementwise"}), "are not sgd's"),
    (lambda m: m["optimizer"].update(states={"momentum_buffer": "rowwise"}), "are not sgd's"),
    (lambda m: m["optimizer"].pop("states"), "are not sgd's"),
    (lambda m: m.update(version=3), "needs version 4"),
    (lambda m: m["optimizer"].update(type="soap"), "SOAP .* is not supported yet"),
    (lambda m: m["optimizer"].update(type="adam"), "must be \\['fp32', 'exp_avg', 'exp_avg_sq'\\]"),
])
def test_edited_optimizer_sections_are_refused_in_one_line(tmp_path, edit, why):
    path, _ = write_sgd(tmp_path / "sgd")
    meta = json.loads((path / METADATA_FILENAME).read_text())
    edit(meta)
    if meta["optimizer"]["type"] == "adam":
        meta["optimizer"].pop("states")
    (path / METADATA_FILENAME).write_text(json.dumps(meta))
    reseal(path)
    with pytest.raises(UniversalFormatError, match=why) as e:
        UniversalCheckpoint.open(path)
    assert "\n" not in str(e.value)


def test_state_names_are_checked_before_they_name_a_key(tmp_path):
    for bad in ("../x", "Exp_avg", "exp avg", "", "a" * 80, 3, "moment2_buffer"):
        with pytest.raises(ValueError):
            optimizers.check_state_name(bad)
    with pytest.raises(UniversalFormatError, match="not one megatron-ucp knows"):
        write_sgd(tmp_path / "evil", momentum_key="__metadata__")


@pytest.mark.parametrize("name, words", [
    ("dist_muon", "dist_muon"), ("soap", "SOAP"), ("adaptive_muon", "adaptive Muon"),
    ("shampoo", "is not one megatron-ucp knows")])
def test_unmapped_optimizers_are_refused_at_conversion_time(name, words):
    with pytest.raises(CheckpointFormatError) as e:
        optimizer_row({"optimizer": name}, "ckpt/common.pt", distributed=False, layer_wise=None)
    line = str(e.value)
    assert "\n" not in line and f"args.optimizer={name!r}" in line and words in line
    if name != "shampoo":
        assert "is not supported yet" in line and "--no-load-optim" in line


def test_lion_and_muon_give_each_parameter_megatron_cores_row():
    """megatron-core 0.19's split (_is_nonlinear_or_embedding): 2-D weights but the embedding and the output layer
    take the emerging optimizer, the rest its scalar optimizer (Lion: Adam; Muon: --muon-scalar-optimizer)."""
    from megatron_ucp.adapters.gpt import parameter_optimizer

    qkv, norm = "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.input_layernorm.weight"
    for run, scalar in (("lion", "adam"), ("muon", "adam")):
        args = {"optimizer": run}
        assert parameter_optimizer(qkv, (64, 32), args) == run
        assert parameter_optimizer(norm, (32,), args) == scalar
        assert parameter_optimizer("embedding.word_embeddings.weight", (256, 32), args) == scalar
        assert parameter_optimizer("output_layer.weight", (256, 32), args) == scalar
        assert optimizers.run_optimizers(run, args) == (run, scalar)
    assert parameter_optimizer(norm, (32,), {"optimizer": "muon", "muon_scalar_optimizer": "lion"}) == "lion"
    assert optimizers.run_states("muon", {"muon_scalar_optimizer": "lion"}) == ("exp_avg", "momentum_buffer")
    assert optimizers.run_states("lion", {}) == ("exp_avg", "exp_avg_sq")
    assert parameter_optimizer(qkv, (64, 32), {"optimizer": "adam"}) == "adam"
    with pytest.raises(CheckpointFormatError, match="--muon-scalar-optimizer 'sgd': megatron-core 0.19 builds adam"):
        optimizer_row({"optimizer": "muon", "muon_scalar_optimizer": "sgd"}, "x", distributed=False, layer_wise=None)


def test_layer_wise_and_distributed_sgd_are_refused_and_the_rows_are_read():
    """The layer-wise distributed optimizer is read where its reader maps it (torch_dist dp_reshardable:
    tests/test_optim_lion_muon_resume.py); elsewhere (a legacy save, another sharding type, none of them measured) it
    is refused in one line naming the way out, and with an optimizer megatron-core never runs under it the args are
    inconsistent."""
    def row(args, distributed=False, layer_wise=None):
        return optimizer_row(args, "x", distributed=distributed, layer_wise=layer_wise)

    assert row({"optimizer": "sgd"}).states == ("momentum_buffer",)
    assert row({}, distributed=True).states == ("exp_avg", "exp_avg_sq")
    with pytest.raises(CheckpointFormatError, match="megatron-core 0.19 builds sgd without --use-distributed"):
        row({"optimizer": "sgd"}, distributed=True)
    layer_wise = {"optimizer": "muon", "use_layer_wise_distributed_optimizer": True}
    assert row(layer_wise, distributed=True).name == "muon"
    for why in (optimizers.LAYER_WISE_LEGACY_REFUSAL, optimizers.layer_wise_sharding_refusal("fully_reshardable")):
        with pytest.raises(CheckpointFormatError) as e:
            row(layer_wise, distributed=True, layer_wise=why)
        line = str(e.value)
        assert "\n" not in line and "layer-wise distributed optimizer's state" in line and "not supported" in line
        assert "to-universal --weights-only" in line and "--no-load-optim" in line, line
    with pytest.raises(CheckpointFormatError, match=r"for the emerging optimizers \(lion, muon\) only"):
        row({"optimizer": "sgd", "use_layer_wise_distributed_optimizer": True})
    with pytest.raises(CheckpointFormatError, match="with lion for the scalar parameters .* cannot save it"):
        row({**layer_wise, "muon_scalar_optimizer": "lion"}, distributed=True)


def test_the_loader_refuses_at_argument_time():
    import types

    from megatron_ucp.megatron_lm.loader import UniversalLoadError, check_run_optimizer

    def args(**kw):
        return types.SimpleNamespace(**{"optimizer": "adam", "use_distributed_optimizer": False,
                                        "no_load_optim": False, "finetune": False, **kw})

    check_run_optimizer(args(optimizer="sgd"))
    with pytest.raises(UniversalLoadError, match="--optimizer sgd with --use-distributed-optimizer: megatron-core"):
        check_run_optimizer(args(optimizer="sgd", use_distributed_optimizer=True))
    for name in ("dist_muon", "soap", "adaptive_muon"):
        with pytest.raises(UniversalLoadError, match=f"--optimizer {name}: .* is not supported yet"):
            check_run_optimizer(args(optimizer=name))
        check_run_optimizer(args(optimizer=name, no_load_optim=True))  # weights only: nothing to map
    for name in ("lion", "muon"):
        check_run_optimizer(args(optimizer=name))
        check_run_optimizer(args(optimizer=name, use_layer_wise_distributed_optimizer=True))
    with pytest.raises(UniversalLoadError, match="with lion for the scalar parameters under the layer-wise"):
        check_run_optimizer(args(optimizer="muon", muon_scalar_optimizer="lion", use_layer_wise_distributed_optimizer=True))
