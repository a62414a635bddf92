"""The Open Inference Protocol v2 over gRPC (`--grpc-port`): inference.proto, its generated modules, the service."""
