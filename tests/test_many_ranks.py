"""A many-rank job against a store that pushes back, every rank's requests logged by a RequestProxy.

Four gloo ranks (ckptstore.testing.dcpjob) save and restore sixteen sharded
DTensors, a replicated one and an int through ckptstore.dcp, each rank
through its own proxy endpoint. What one rank can read for the job, one
rank reads: the restart lists the store once and reads the root manifest
and config once; a save reads the config and its dedup base's root once.
Then the same job under a request-rate cap, and with one rank's uploads
stalled. See docs/dcp.md, "Many ranks".
"""

from __future__ import annotations

import copy

import pytest

from ckptstore.storage.retry import RetryPolicy
from ckptstore.testing.dcpjob import run_job as _run_job
from ckptstore.testing.requestproxy import RequestProxy, match

pytestmark = pytest.mark.slow  # spawned gloo ranks

WORLD = 4
URL = "s3://ckpt-test/run"


@pytest.fixture
def proxy(s3):
    with RequestProxy(s3.server.endpoint) as p:
        yield p


def run_job(*args, **kwargs):
    # forked from this process (torch already imported): seconds a job instead of the imports
    return _run_job(*args, start_method="fork", **kwargs)


def _per_rank(s3, proxy, **extra):
    out = []
    for r in range(WORLD):
        so = copy.deepcopy(s3.storage_options)
        so["client_kwargs"]["endpoint_url"] = proxy.endpoint(f"rank{r}")
        so.update(extra)
        out.append(so)
    return out


def _ok(results):
    assert all(r == ["ok"] * len(r) for r in results), results


def _readers(proxy, prefix: str) -> dict[str, set[str]]:
    """Metadata key -> the ranks that read it (GET or HEAD, answered by the server)."""
    out: dict[str, set[str]] = {}
    for r in proxy.requests(lambda r: r.kind in ("GET", "HEAD") and not r.injected and r.key.startswith(prefix)):
        out.setdefault(r.key, set()).add(r.label)
    return out


def _gets(proxy, key_prefix):
    return len(proxy.requests(match(kind="GET", key_prefix=key_prefix)))


def test_one_listing_and_one_read_of_shared_metadata_per_job(s3, proxy, tmp_path):
    so = _per_rank(s3, proxy)
    _ok(run_job(WORLD, URL, [("save", 1)], so, tmp_path))
    first = proxy.counts()
    assert first["LIST"] == 1 and _gets(proxy, "run/config.json") <= 2  # a new repository: miss, create, read
    proxy.clear()

    _ok(run_job(WORLD, URL, [("save", 2)], so, tmp_path))  # deduplicates against step 1
    assert proxy.counts()["LIST"] == 1
    assert _gets(proxy, "run/config.json") == 1
    assert _gets(proxy, "run/manifests/00000000000000000001.json") == 1  # the dedup base's root, once
    assert {lbl for k, lbl in _readers(proxy, "run/manifests/").items() for lbl in lbl} == {"rank0"}
    proxy.clear()

    # The restart: a storm of 503 on the first listings, then one listing that succeeds
    storm = proxy.fail(match(kind="LIST"), count=3)
    _ok(run_job(WORLD, URL, [("load", None)], so, tmp_path, expect=2))
    assert storm.fired == 3
    lists = proxy.requests(match(kind="LIST"))
    assert len([r for r in lists if not r.injected]) == 1 and {r.label for r in lists} == {"rank0"}
    counts = proxy.counts()
    assert counts["HEAD"] <= 1
    assert _gets(proxy, "run/manifests/") == 1 and _gets(proxy, "run/config.json") <= 1
    # the root and the config are read by one rank; no chunk-table segment by every rank (the one
    # holding the int every rank loads included): a segment is read by the rank that owns a box of it,
    # and by a second one at most where the save cut a replicated tensor across writers
    for prefix in ("run/config.json", "run/manifests/"):
        assert all(len(ranks) == 1 for ranks in _readers(proxy, prefix).values())
    segments = _readers(proxy, "run/segments/")
    assert segments and all(len(ranks) <= 2 for ranks in segments.values()), segments
    for key, ranks in segments.items():
        assert _gets(proxy, key) <= 2 * len(ranks)  # a header and a block of records each


def _segments_of(url_so, step: int, keys) -> set[str]:
    """The keys (under ``run/``) of the chunk-table segments holding tensors ``keys`` of ``step``."""
    import ckptstore
    from ckptstore.format.layout import segment_key

    with ckptstore.open(URL, storage_options=url_so) as repo:
        m = repo.manifest(step)
        out = set()
        for k in keys:
            for row in m.tensors[k].tables():
                out.add("run/" + segment_key(m.segments[int(row[0])].id))
        return out


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "every-rank-reads-its-own"])
def test_a_restart_reads_every_object_several_ranks_need_once_per_job(s3, proxy, tmp_path, exchange):
    # issue 44 item 4: what several ranks of a job need (the newest step, the root, the config,
    # and the chunk-table segments their reads share) is read by one rank, once, and shared
    so = _per_rank(s3, proxy)
    _ok(run_job(WORLD, URL, [("save", 1), ("save", 2)], so, tmp_path))
    proxy.clear()
    options = {} if exchange else {"exchange_replicated": False}
    _ok(run_job(WORLD, URL, [("load", None)], so, tmp_path, expect=2, options=options))
    gets: dict[str, int] = {}
    for r in proxy.requests(match(kind="GET")):
        if not r.injected and not r.key.startswith("run/packs/"):
            gets[r.key] = gets.get(r.key, 0) + 1
    readers = _readers(proxy, "run/")
    readers = {k: v for k, v in readers.items() if not k.startswith("run/packs/")}
    assert proxy.counts()["LIST"] == 1
    # every metadata object is read by one rank of the job, never by two
    assert readers and all(len(ranks) == 1 for ranks in readers.values()), readers
    # ... and once: the root and the config; a segment a single rank needs, as its header and a block
    assert gets["run/manifests/00000000000000000002.json"] == 1 and gets["run/config.json"] == 1, gets
    assert all(n <= 2 for n in gets.values()), gets
    if not exchange:
        # every rank loads the int and the replicated tensor itself: their segments are needed by
        # all 4 ranks (each read 4 times before, a header and a block each), now read once, whole
        everyone = _segments_of(s3.storage_options, 2, ["step", "replicated.weight"])
        assert everyone and all(gets.get(k) == 1 for k in everyone), (everyone, gets)


def test_under_a_request_rate_cap_save_and_restore_complete_with_at_most_half_throttled(s3, proxy, tmp_path):
    so = _per_rank(s3, proxy)
    bucket = proxy.rate_limit(6.0)  # requests a second, all ranks together; 503 SlowDown above it
    results = run_job(WORLD, URL, [("save", 1), ("load", 1)], so, tmp_path, shape=(16, 512, 256))
    _ok(results)  # bit-exact: the job compares every element
    reqs = proxy.requests()
    throttled = sum(1 for r in reqs if r.injected)
    assert bucket.fired == throttled > 0  # the cap did bite
    assert throttled <= len(reqs) / 2, (throttled, len(reqs), proxy.counts())


def test_a_rank_whose_uploads_stall_fails_every_rank_and_the_next_save_works(s3, proxy, tmp_path):
    # short timeouts so that the stalled rank gives up in seconds: 2 tries x 2 attempts of 2 s
    so = _per_rank(s3, proxy, read_timeout=2, connect_timeout=2)
    proxy.stall(match(label="rank1", kind="PUT", key_prefix="run/packs/"), count=4)
    options = {"retry": RetryPolicy(max_attempts=2, base_delay=0.05, max_total=600)}
    results = run_job(WORLD, URL, [("save", 1), ("save", 2), ("load", None)], so, tmp_path, expect=2,
                      options=options, stop_on_error=False)
    for rank, res in enumerate(results):
        assert "rank 1" in res[0] and "step 1" in res[0], (rank, res[0])  # every rank names the stalled one
        assert res[1:] == ["ok", "ok"], (rank, res)
    import ckptstore

    assert ckptstore.open(URL, storage_options=s3.storage_options).steps() == [2]  # step 1 never committed
