"""The `tcp` backend (`backend.TcpBackend`)."""
