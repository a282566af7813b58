"""The gateway's HTTP edge: the two HTTP/SSE bridges (v1, deprecated, and v2), their errors,
the edge rules every request meets, browser sign-in and the web console. A bridge calls the gRPC
servicer it is given, so nothing decides anything twice; uses `live/`; never imports `grpc/`."""
