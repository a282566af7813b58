"""What the gateway streams: the event hub (one Redis subscription per process), a run's
stream, a conversation's stream and the live run list. Imports neither `grpc/` nor `http/`:
both edges serve the same streams."""
