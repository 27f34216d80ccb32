"""Test support: store conformance suite, local servers, fault injection, shared helpers.

Importing this package imports neither torch nor any server: each server
lives in its own module (:mod:`.moto`, :mod:`.gcs_emulator`, :mod:`.azurite`,
:mod:`.seaweedfs`, :mod:`.faultproxy`). Only the small helpers every test
and benchmark shares are exported here.
"""

from .compare import bits_equal
from .ports import free_port, free_ports

__all__ = ["bits_equal", "free_port", "free_ports"]
