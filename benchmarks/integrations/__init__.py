"""DeepSpeed, Megatron-Core, Hugging Face and Lightning next to their own checkpoint paths (see benchmarks/README.md)."""
