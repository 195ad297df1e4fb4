"""A faithful simulated SGLang worker: radix cache, batching and latency model, HTTP API."""
