"""Helpers every benchmark shares, one module per concern.

* :mod:`.measure`: clocks and counters (wall time, CPU seconds of this
  process and of a server process, RSS, page faults), sizes on disk, medians;
* :mod:`.verify`: bit-exact comparison of what was loaded with what was saved;
* :mod:`.data`: the synthetic fp32 state dict most benchmarks use;
* :mod:`.report`: byte sizes as text, tables, the command line, the
  environment, the JSON results file;
* :mod:`.servers`: S3 servers (moto in its own process, SeaweedFS) started by
  ``ckptstore.testing``'s starters, behind one small handle;
* :mod:`.pinning`: CPU affinity of a server process and of this client.

Nothing is imported here, so that a benchmark that needs no torch (the
charts) can import :mod:`.report` without it.
"""
