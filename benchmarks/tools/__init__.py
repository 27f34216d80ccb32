"""Not measurements themselves: A/B of library trees, the charts (see benchmarks/README.md)."""
