"""Several ranks or processes: multi-rank DCP, replicated state, the node-local tier, metadata at scale (see benchmarks/README.md)."""
