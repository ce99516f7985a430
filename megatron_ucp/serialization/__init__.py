"""Generic torch serialization, Megatron-agnostic: torch.save's zip archives and DCP's `.metadata` read without
torch and without running their code (`safe_pickle`: the allow-list unpickler; what a family of packages adds to
its pickles comes from the caller as a `PickleFamily`), torch.save's format written without torch (`torch_save`),
and saved tensors as records of their bytes (`records`). Imports only `core/` (dtypes) and `io/` (byte regions);
`formats/` builds Megatron's checkpoint formats on it."""
