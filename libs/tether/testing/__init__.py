"""Test helpers shared by the test suites and benchmarks.

`tether.testing.model_server` is a local Anthropic-compatible HTTP server with scripted turns,
fault injection and a deterministic demo agent. The package itself imports nothing so that
`python -m tether.testing.model_server` does not load the module twice.
"""
