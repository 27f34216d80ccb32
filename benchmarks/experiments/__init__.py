"""One-off measurements, each of which answered one question at one commit (docs/data/README.md lists them)."""
