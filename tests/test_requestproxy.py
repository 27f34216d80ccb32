"""A store that pushes back or differs from S3, played by ckptstore.testing.requestproxy in front of moto.

Each test runs one process against the proxy: storms of 503 on listings and
uploads, a store that drops ``If-None-Match``, Cloudflare R2's equal-part
rule and CoreWeave's 15 MiB parts, credentials that expire, and the proxy's
own bookkeeping. The many-rank versions are in test_many_ranks.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ckptstore
from ckptstore.errors import ConditionalWriteUnsupportedError, StorageError, StoreThrottledError
from ckptstore.pipeline.options import RepoOptions
from ckptstore.storage.retry import RetryPolicy
from ckptstore.testing.requestproxy import RequestProxy, credential_process_script, issue_key, match

MiB = 1 << 20


@pytest.fixture
def proxy(s3):
    with RequestProxy(s3.server.endpoint) as p:
        yield p


def _so(s3, proxy, label="p"):
    so = copy.deepcopy(s3.storage_options)
    so["client_kwargs"]["endpoint_url"] = proxy.endpoint(label)
    return so


def _state(seed=0, n=3 * MiB):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n // 4, generator=g), "step": seed}


def _same(a, b):
    return torch.equal(a["w"].view(torch.int32), b["w"].view(torch.int32)) and a["step"] == b["step"]


def test_requests_are_logged_by_client_and_kind(s3, proxy):
    repo = ckptstore.open(s3.url, storage_options=_so(s3, proxy, "a"), part_size=5 * MiB, chunk_size=1 * MiB)
    repo.save(_state(1, 12 * MiB), step=1)
    save = proxy.counts()
    assert save["MPU_CREATE"] >= 1 and save["PART"] >= 3 and save["MPU_COMPLETE"] >= 1 and save["LIST"] == 1
    proxy.clear()
    other = ckptstore.open(s3.url, storage_options=_so(s3, proxy, "b"))
    assert _same(other.load(1), _state(1, 12 * MiB))
    assert set(proxy.counts("label")) == {"b"}
    assert proxy.counts(pred=match(kind="GET", key_prefix="repo/manifests/"))["GET"] == 1
    assert all(r.status in (200, 206) for r in proxy.requests())


def test_a_storm_of_503_on_listings_is_waited_out(s3, proxy):
    so = _so(s3, proxy)
    ckptstore.open(s3.url, storage_options=so).save(_state(1), step=1)
    storm = proxy.fail(match(kind="LIST"), count=4, retry_after=0.05)
    repo = ckptstore.open(s3.url, storage_options=so)
    assert repo.latest() == 1  # not None: the step is there
    assert storm.fired == 4
    assert repo.store.throttle_stats()["throttled"] >= 4


def test_a_listing_that_stays_throttled_raises_never_no_checkpoint(s3, proxy):
    so = _so(s3, proxy)
    ckptstore.open(s3.url, storage_options=so).save(_state(1), step=1)
    proxy.fail(match(kind="LIST"), count=None)
    repo = ckptstore.open(s3.url, storage_options=so, retry=RetryPolicy(max_attempts=2, base_delay=0.01))
    with pytest.raises(StoreThrottledError, match="SlowDown.*kept throttling"):
        repo.latest()
    with pytest.raises(StoreThrottledError):
        repo.load()


@pytest.mark.slow  # six 503s on 12 MiB of parts, each retried after botocore's real backoff (~9 s)
def test_a_storm_of_503_on_uploads_still_saves_bit_exact(s3, proxy):
    so = _so(s3, proxy)
    storm = proxy.fail(match(kind=("PART", "PUT")), count=6)
    repo = ckptstore.open(s3.url, storage_options=so, part_size=5 * MiB, chunk_size=1 * MiB)
    repo.save(_state(2, 12 * MiB), step=2)
    assert storm.fired == 6
    assert _same(ckptstore.open(s3.url, storage_options=so).load(2), _state(2, 12 * MiB))


def test_a_store_that_ignores_if_none_match_is_refused_and_nothing_is_committed(s3, proxy):
    proxy.drop_if_none_match = True
    repo = ckptstore.open(s3.url, storage_options=_so(s3, proxy, "fake"))
    with pytest.raises(ConditionalWriteUnsupportedError, match="accepted a second conditional create"):
        repo.save(_state(1), step=1)
    assert repo.steps() == [] and list(repo.store.list("")) == []  # no config, no pack, no probe left
    # the same bucket through an honest endpoint: the probe passes, once per store
    proxy.drop_if_none_match = False
    honest = ckptstore.open(s3.url, storage_options=_so(s3, proxy, "honest"))
    honest.save(_state(1), step=1)
    honest.save(_state(2), step=2)
    probes = [r for r in proxy.requests(match(label="honest", key_prefix="repo/leases/probe-"))]
    assert [r.kind for r in probes] == ["PUT", "PUT", "DELETE"]
    assert [r.status for r in probes[:2]] == [200, 412]


def test_r2s_equal_parts_rule_holds(s3, proxy):
    rules = proxy.part_rules(equal=True)
    repo = ckptstore.open(s3.url, storage_options=_so(s3, proxy), part_size=5 * MiB, chunk_size=1 * MiB,
                          pack_size=64 * MiB)
    repo.save(_state(3, 23 * MiB), step=3)  # 4 or more parts: all but the last of 5 MiB
    assert proxy.counts()["PART"] >= 4 and rules.refused == 0
    assert _same(repo.load(3), _state(3, 23 * MiB))


def test_a_store_with_15_mib_parts(s3, proxy):
    proxy.part_rules(equal=True, min_size=15 * MiB)
    so = _so(s3, proxy)
    # unannounced: the store's refusal says what to do, and nothing is committed
    repo = ckptstore.open(s3.url, storage_options=so, part_size=8 * MiB, chunk_size=1 * MiB)
    with pytest.raises(StorageError, match="EntityTooSmall.*min_part_size"):
        repo.save(_state(4, 20 * MiB), step=4)
    assert repo.steps() == []
    # announced: a part_size below it is refused at open, and the default grows to it
    so15 = dict(so, min_part_size="15MiB")
    with pytest.raises(ValueError, match="part_size=8388608 is below the smallest multipart part"):
        ckptstore.open(s3.url, storage_options=so15, part_size=8 * MiB)
    repo = ckptstore.open(s3.url, storage_options=so15, chunk_size=1 * MiB, max_inflight_bytes=256 * MiB)
    assert repo.options.part_size >= 15 * MiB
    repo.save(_state(4, 40 * MiB), step=4)
    assert _same(repo.load(4), _state(4, 40 * MiB))
    with pytest.raises(ValueError, match="min_part_size must be at least"):
        ckptstore.open(s3.url, storage_options=dict(so, min_part_size="1MiB"))


def test_part_size_grows_so_that_no_pack_needs_more_than_10000_parts():
    o = RepoOptions.from_kwargs(True, pack_size=400 << 30)
    assert o.part_size % MiB == 0 and (400 << 30) / o.part_size < 10_000
    assert RepoOptions.from_kwargs(True).part_size == 16 * MiB  # the default is untouched


def test_credentials_from_a_credential_process_are_refreshed_not_frozen(s3, proxy, tmp_path, monkeypatch):
    script = credential_process_script(tmp_path / "creds.py", refresh_after=1.0)
    config = tmp_path / "aws_config"
    config.write_text(f"[profile rotating]\ncredential_process = {script}\nregion = us-east-1\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    proxy.expire_keys(lifetime=4.0)  # a key is refused 4 s after it was issued
    so = {"profile": "rotating", "client_kwargs": {"endpoint_url": proxy.endpoint("rot")},
          "config_kwargs": {"proxies": {}}}
    repo = ckptstore.open(s3.url, storage_options=so)
    step = 0
    # one handle, saving for as long as it takes to have used three keys (about 2 s)
    while len(_keys(proxy)) < 3 and step < 200:
        step += 1
        repo.save(_state(step, 64 << 10), step=step)
    assert len(_keys(proxy)) >= 3
    assert proxy.expired == 0
    assert _same(repo.load(step), _state(step, 64 << 10))
    assert issue_key("ckpt").startswith("ckpt")


def _keys(proxy) -> set[str]:
    return {r.access_key for r in proxy.requests() if r.access_key}
