"""What Megatron's pickles hold beyond plain torch values, as the generic unpickler's `PickleFamily`
(serialization/safe_pickle.py): the enums Megatron-LM pickles inside `args`, the packages whose unknown classes
load as inert records, and megatron-core's subclasses of DCP's metadata records. Every reader of a Megatron
checkpoint loads its pickles with `MEGATRON`; writers pickle an enum member again only if it is one of
`MEGATRON_ENUMS`."""

from __future__ import annotations

from megatron_ucp.serialization.safe_pickle import PickleFamily

# Megatron-LM pickles these enums inside `args` (megatron/core/safe_globals.py); kept as PickledEnum.
MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.CudaGraphModule",  # megatron-core >= 0.18 (cuda_graph_modules)
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    # megatron-core >= 0.18 (inference_cuda_graph_scope); 0.17 has no such class: writes for it never pickle one
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
)

# Where the classes of the Megatron family live (megatron-core, Megatron-LM, Transformer Engine, Apex, NVIDIA's
# resiliency and model-optimizer packages, NeMo / Megatron-Bridge). A class from these packages that megatron-ucp
# has never seen (a newer release's enum or dataclass in `args`) loads as an InertRecord; a name from anywhere
# else outside the allow-list (os, builtins, subprocess, ...: what a crafted pickle calls) is refused.
RECORD_NAMESPACES = ("megatron.", "transformer_engine.", "apex.", "nvidia_resiliency_ext.", "modelopt.", "nemo.",
                     "megatron_bridge.")

MEGATRON = PickleFamily(
    holder="a Megatron checkpoint",
    enums=MEGATRON_ENUMS,
    namespaces=RECORD_NAMESPACES,
    # empty subclasses megatron-core 0.16 keeps so that the .metadata of megatron-core <= 0.15 still unpickles
    dcp_records={"megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata": "Metadata",
                 "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan": "SavePlan"},
)

__all__ = ["MEGATRON", "MEGATRON_ENUMS", "RECORD_NAMESPACES"]
