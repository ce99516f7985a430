"""The run state a universal checkpoint carries besides tensors (docs/FORMAT.md "Loss scaler", "RNG states").

On Megatron-LM's own fixtures (A: legacy TP2 PP2 DP2, B: torch_dist, C: legacy plain Adam): every rank's
RNG state goes into rng_states.json and comes back from its JSON form exactly as Megatron-LM pickled it
(python random and numpy Mersenne-Twister states, torch generator bytes, tracker streams: equal value for
value); the file is checked against the sha256 metadata.json records (a changed byte is refused by the
reader and reported by `check`); malformed loss-scaler metadata is refused at open. The end-to-end proofs
(dropout resumed exactly, fp16 scaler restored) are in test_e2e_dropout_rng.py and test_e2e_precision.py.
"""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from pretrain_runs import FIXTURE_CKPTS

from megatron_ucp.commands.check import check
from megatron_ucp.convert import to_universal
from megatron_ucp.core.run_state import LossScalerState, RankRngState, RunStateError
from megatron_ucp.universal import RNG_FILENAME, UniversalCheckpoint, UniversalFormatError


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ucp")
    return {label: to_universal(FIXTURE_CKPTS[label], root / label, iteration=4, progress=False) for label in "ABC"}


def assert_same_rng(ours: dict, theirs: dict, where: str) -> None:
    assert ours["random_rng_state"] == theirs["random_rng_state"], where
    a, b = ours["np_rng_state"], theirs["np_rng_state"]
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[1].dtype == b[1].dtype and a[2:] == b[2:], where
    for key in ("torch_rng_state", "cuda_rng_state"):
        assert torch.equal(ours[key], theirs[key]), (where, key)
    assert ours["rng_tracker_states"].keys() == theirs["rng_tracker_states"].keys(), where
    for name, state in theirs["rng_tracker_states"].items():
        assert torch.equal(ours["rng_tracker_states"][name], state), (where, name)


@pytest.mark.parametrize("label", ["A", "C"])
def test_rng_states_round_trip_exactly(converted, label):
    ucp = UniversalCheckpoint.open(converted[label])
    assert ucp.rng_section["layout"] == {"tp": 2, "pp": 2, "dp": 2 if label == "A" else 1, "vpp": None,
                                         "sp": label == "A", "ep": 1, "etp": None}
    states = {(s.pp, s.tp): s for s in ucp.rng_states()}
    assert sorted(states) == [(0, 0), (0, 1), (1, 0), (1, 1)] and ucp.rng_section["ranks"] == 4
    for (pp, tp), state in states.items():
        path = FIXTURE_CKPTS[label] / "iter_0000004" / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt"
        saved = torch.load(path, weights_only=False)["rng_state"]
        assert len(saved) == 1 and state.dp is None
        assert_same_rng(state.to_megatron(), saved[0], f"{label} pp={pp} tp={tp}")
        # and the live values give the same JSON entry back
        assert RankRngState.from_saved(saved[0], pp=pp, tp=tp, dp=None, where="live") == state


def test_torch_dist_rng_states_equal_the_legacy_ones(converted):
    """Fixtures A and B are the same run saved in both formats: the same RNG states, whichever reader."""
    a, b = UniversalCheckpoint.open(converted["A"]), UniversalCheckpoint.open(converted["B"])
    assert a.rng_states() == b.rng_states() and a.loss_scaler is None and b.loss_scaler is None


def test_changed_rng_file_is_refused_and_reported(converted, tmp_path):
    ucp = tmp_path / "ucp"
    shutil.copytree(converted["C"], ucp)
    data = bytearray((ucp / RNG_FILENAME).read_bytes())
    data[data.index(b'"torch_cpu":"') + 20] ^= 1  # one base64 character of rank (0, 0)'s generator
    (ucp / RNG_FILENAME).write_bytes(bytes(data))
    with pytest.raises(UniversalFormatError, match=f"{RNG_FILENAME}: its sha256 differs"):
        UniversalCheckpoint.open(ucp).rng_states()
    result = check(ucp)
    assert not result["ok"] and any(RNG_FILENAME in p and "sha256" in p for p in result["problems"]), result
    (ucp / RNG_FILENAME).unlink()
    assert any(RNG_FILENAME in p for p in check(ucp)["problems"])


def _edit_metadata(src, dst, edit):
    shutil.copytree(src, dst)
    meta = json.loads((dst / "metadata.json").read_text())
    edit(meta)
    (dst / "metadata.json").write_text(json.dumps(meta))
    complete = json.loads((dst / "COMPLETE").read_text())
    complete["metadata_sha256"] = hashlib.sha256((dst / "metadata.json").read_bytes()).hexdigest()
    (dst / "COMPLETE").write_text(json.dumps(complete))
    return dst


@pytest.mark.parametrize("scaler,message", [
    ({"scale": 65536.0, "growth_tracker": 2}, "expected scale, growth_tracker and hysteresis_tracker"),
    ({"scale": -1.0, "growth_tracker": 0, "hysteresis_tracker": 2}, "is not a positive finite number"),
    ({"scale": 4.0, "growth_tracker": 0.5, "hysteresis_tracker": 2}, "0.5 is not an integer"),
    ([65536.0], "expected an object or null"),
])
def test_malformed_loss_scaler_is_refused(converted, tmp_path, scaler, message):
    ucp = _edit_metadata(converted["C"], tmp_path / "ucp", lambda meta: meta.update(loss_scaler=scaler))
    with pytest.raises(UniversalFormatError, match=message):
        UniversalCheckpoint.open(ucp)


def test_loss_scaler_json_form():
    state = LossScalerState.from_saved({"scale": torch.tensor([131072.0]), "growth_tracker": 1,
                                        "hysteresis_tracker": 1}, "live")
    assert state == LossScalerState(131072.0, 1, 1)
    assert LossScalerState.from_json(state.to_json(), "json") == state
    megatron = state.to_megatron()
    assert megatron["scale"].dtype == torch.float32 and megatron["scale"].shape == (1,)
    assert LossScalerState.from_saved({}, "constant scaler") is None  # ConstantGradScaler saves nothing
    with pytest.raises(RunStateError, match="not a version-3 Mersenne-Twister state"):
        RankRngState.from_json({"pp": 0, "tp": 0, "python": {"version": 3, "state": [1, 2], "gauss_next": None},
                                "numpy": {}, "torch_cpu": "", "cuda": "", "tracker": {}}, "x")
