"""What every service runs on, in one place:

- `process`: logging, signals, the ready file, serving until stopped;
- `tasks`: supervised background tasks, and rounds that sleep until their next deadline;
- `rpc`: gRPC servers and internal channels, with the interceptors that authenticate callers and
  translate errors (`tether.errors`) both ways;
- `subscription`: the one Redis pub/sub loop (sees every lost connection, pings, confirms).
- `tls`: mutual TLS for internal gRPC, off unless a CA is configured;
- `readiness`: not ready for calls until the database's schema is at this release's migrations.
"""
