"""A user's own Megatron-LM 0.19 pretraining script with --universal-checkpoint enabled the way
docs/TRAINING.md ("Your own Megatron-LM script") says: one import and two arguments around Megatron-LM's own
parse_and_validate_args and pretrain. The providers are the user's (here borrowed from the project's entry
point, as a user's would come from Megatron-LM's pretrain_gpt.py); nothing else of megatron-ucp runs, except the
CPU patches this CPU machine needs (a GPU user needs none).

    torchrun --nproc-per-node N tests/user_pretrain_script.py <Megatron-LM flags> --load UCP --universal-checkpoint
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ucp.megatron_lm import cpu_shims  # noqa: E402

cpu_shims.install_import_patches()  # CPU machine only: Python 3.11 and no triton

from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import pretrain  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

from megatron_ucp.megatron_lm.pretrain_gpt import (  # noqa: E402  (the user's own providers)
    forward_step,
    model_provider,
    train_valid_test_datasets_provider,
)

if __name__ == "__main__":
    if cpu_shims.install():  # CPU machine only
        sys.argv[1:] = cpu_shims.with_cpu_flags(sys.argv[1:])
    from megatron_ucp.megatron_lm import universal_plugin

    universal_plugin.install()
    args = parse_and_validate_args(extra_args_provider=universal_plugin.add_arguments,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider=model_provider)
