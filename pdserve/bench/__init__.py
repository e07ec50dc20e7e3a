"""A benchmark client for any OpenAI-compatible server (`pdserve bench`).

Torch-free and independent of the rest of pdserve: `workloads` (what to send), `client` (one
streamed, timed request), `runner` (arrivals, concurrency, deadlines), `metrics` (percentiles,
throughput, goodput), `goodput` (SLO attainment and goodput over a rate sweep),
`plots` (PNG), `command` (flags and the run).
"""
