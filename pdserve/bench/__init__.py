"""A benchmark client for any OpenAI-compatible server (`pdserve bench`).

Torch-free and independent of the rest of pdserve: `workloads` (what to send), `client` (one
streamed, timed request), `runner` (arrivals and concurrency), `metrics` (percentiles,
throughput, goodput), `plots` (PNG), `command` (flags and the run).
"""
