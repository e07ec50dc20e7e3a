"""The prefill worker's side of disaggregation: bootstrap queue -> prefill -> send KV -> done."""
