"""The `memory` backend (`backend.MemoryBackend`)."""
