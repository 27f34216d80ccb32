"""pytest plugin of a framework-suite run: tells every process which test runs now.

Before each test it writes the test's id, made safe for a path, to
``$CKPTSTORE_SUITE_DIR/current`` (see ``sitecustomize``), so each test gets
a repository of its own.
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest


def slug(nodeid: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid.split("::", 1)[-1])[:80]
    return f"{name}-{hashlib.sha1(nodeid.encode()).hexdigest()[:8]}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    d = os.environ.get("CKPTSTORE_SUITE_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, "current.tmp")
        with open(tmp, "w") as f:
            f.write(slug(item.nodeid))
        os.replace(tmp, os.path.join(d, "current"))
