"""One component or one process: codec, hashing, memory, S3 clients, failure bounds, CUDA (see benchmarks/README.md)."""
