"""The colocated worker: prefill and decode in one engine, behind the null handoff."""
