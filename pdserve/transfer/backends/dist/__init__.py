"""The `nccl` and `gloo` backends (`backend.DistBackend`)."""
