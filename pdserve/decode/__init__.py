"""The decode worker's side of disaggregation: pre-allocation -> transfer -> prebuilt batch ->
the ordinary decode loop."""
