"""Megatron-LM's legacy `torch` spelling, both directions: the rank folders and file names the reader,
the writer and the training side share (nothing else spells them).

An iteration folder holds one folder per (tp, pp, ep) rank, `mp_rank_TT` with `_PPP` when PP > 1 and
`_EEE` when EP > 1 (Megatron-LM's get_checkpoint_name), each with `model_optim_rng.pt` and, with the
distributed optimizer, `distrib_optim.pt`. The checkpoint root's tracker and `iter_XXXXXXX` folders are
shared with torch_dist (formats/common.py).
"""

from __future__ import annotations

import re

MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
RANK_DIR_PREFIX = "mp_rank_"
# a data file of the format, relative to the iteration folder
DATA_FILE = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}/(model_optim_rng|distrib_optim)\.pt")
# rank (0, 0, 0)'s folder under each naming (PP and EP, PP or EP alone, neither), for opening before the args
FIRST_RANK_DIRS = ("mp_rank_00_000_000", "mp_rank_00_000", "mp_rank_00")


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's get_checkpoint_name: no pipeline suffix without PP, an expert suffix with EP > 1."""
    name = f"{RANK_DIR_PREFIX}{tp_rank:02d}" if pp == 1 else f"{RANK_DIR_PREFIX}{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep > 1 else "")


def is_rank_dir_name(name: str) -> bool:
    return name.startswith(RANK_DIR_PREFIX)
