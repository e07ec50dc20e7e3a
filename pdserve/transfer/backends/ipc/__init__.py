"""The `ipc` backend (`backend.IpcBackend`)."""
