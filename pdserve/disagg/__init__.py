"""What the prefill and decode workers share around the engine and the transfer layer: the
engine's KV layout for the handshake, failure outputs and their counts. Role glue, kept out of
`pdserve.transfer` (which moves bytes and knows no engine) and out of `pdserve.engine` (which
knows no transfer)."""
