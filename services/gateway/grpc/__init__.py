"""The gateway's public gRPC service: one servicer that authenticates each call and forwards it
to the service that owns it, and the gateway's AdmitStream to admission. Uses `live/` for its
streams; never imports `http/`."""
