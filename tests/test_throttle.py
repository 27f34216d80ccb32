"""Slowing down when the store throttles: the adaptive rate, retries that honour Retry-After and say
the store throttled, and each backend's reading of a throttled answer. No server, no wall clock."""

from __future__ import annotations

import pytest

from ckptstore.errors import StorageError, StoreThrottledError, TransientStorageError
from ckptstore.storage.memory import MemoryStore
from ckptstore.storage.retry import RetryPolicy, RetryStore
from ckptstore.storage.throttle import AdaptiveRate, ThrottlePolicy, parse_retry_after, rate_for


class Clock:
    """Manual time: ``sleep`` advances it."""

    def __init__(self):
        self.t = 1000.0
        self.slept = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def _send(rate: AdaptiveRate, clock: Clock, n: int, throttled=lambda i: False, gap: float = 0.01):
    for i in range(n):
        rate.before()
        clock.t += gap
        rate.after(throttled(i))


def test_unthrottled_process_never_waits():
    clock = Clock()
    rate = AdaptiveRate(clock=clock, sleep=clock.sleep)
    _send(rate, clock, 500)
    assert not rate.enabled and clock.slept == [] and rate.stats()["rate"] is None


def test_a_throttle_lowers_the_rate_then_it_grows_back():
    clock = Clock()
    rate = AdaptiveRate(clock=clock, sleep=clock.sleep)
    _send(rate, clock, 100, gap=0.01)  # about 100 requests a second
    rate.before()
    rate.after(True)
    assert rate.enabled
    first = rate.rate
    assert 40 < first < 100, first  # 0.7 x the rate sent at
    # one more throttle lowers it again
    rate.before()
    rate.after(True)
    assert rate.rate < first
    low = rate.rate
    # answers that succeed let it grow back along the cubic curve, and past the rate throttled
    _send(rate, clock, 400, gap=0.005)
    assert rate.rate > first > low


def test_the_bucket_paces_requests_at_the_rate():
    clock = Clock()
    rate = AdaptiveRate(ThrottlePolicy(min_rate=2.0), clock=clock, sleep=clock.sleep)
    rate.after(True)  # throttled before anything was measured: the floor
    assert rate.enabled and rate.rate == 2.0
    start = clock.t
    for _ in range(10):
        rate.before()
    # 10 requests at 2 a second, from an empty bucket: about 5 seconds of waiting
    assert 4.5 <= clock.t - start <= 5.5
    assert rate.waited == pytest.approx(clock.t - start)


def test_retry_after_pauses_every_request():
    clock = Clock()
    rate = AdaptiveRate(clock=clock, sleep=clock.sleep)
    rate.after(True, retry_after=3.0)
    t0 = clock.t
    rate.before()
    assert clock.t - t0 >= 3.0
    # capped at max_retry_after
    rate2 = AdaptiveRate(ThrottlePolicy(max_retry_after=1.0), clock=clock, sleep=clock.sleep)
    rate2.after(True, retry_after=3600)
    t0 = clock.t
    rate2.before()
    assert clock.t - t0 <= 2.0


def test_one_rate_per_bucket_and_policy():
    a = rate_for("s3|http://x|b1")
    assert rate_for("s3|http://x|b1") is a
    assert rate_for("s3|http://x|b2") is not a
    assert rate_for("s3|http://x|b1", ThrottlePolicy(beta=0.5)) is not a


def test_policy_and_header_checks():
    with pytest.raises(ValueError):
        ThrottlePolicy(beta=1.5)
    with pytest.raises(ValueError):
        ThrottlePolicy(min_rate=0)
    assert parse_retry_after("2") == 2.0 and parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None and parse_retry_after(None) is None


class _Throttling(MemoryStore):
    """``list`` answers like a throttling store for the first ``n`` calls."""

    def __init__(self, name, n, retry_after=None):
        super().__init__(name)
        self.n, self.calls, self.retry_after = n, 0, retry_after

    def list(self, prefix=""):
        self.calls += 1
        if self.calls <= self.n:
            e = TransientStorageError("memory://x: S3 ListObjectsV2 failed (SlowDown): Please reduce your request rate.")
            e.throttled = True
            e.retry_after = self.retry_after
            raise e
        return super().list(prefix)


def test_a_retry_waits_out_retry_after_and_a_storm_is_waited_out():
    clock = Clock()
    inner = _Throttling("throttle-a", 3, retry_after=2.0)
    store = RetryStore(inner, RetryPolicy(max_attempts=8, base_delay=0.01), seed=1, sleep=clock.sleep, monotonic=clock)
    assert list(store.list("manifests/")) == []  # an empty listing only once the store answers
    assert inner.calls == 4 and len(clock.slept) == 3 and all(s >= 2.0 for s in clock.slept)
    MemoryStore.clear("throttle-a")


def test_a_listing_that_stays_throttled_says_so_never_empty():
    clock = Clock()
    inner = _Throttling("throttle-b", 10**6)
    store = RetryStore(inner, RetryPolicy(max_attempts=5, base_delay=0.01), seed=1, sleep=clock.sleep, monotonic=clock)
    with pytest.raises(StoreThrottledError, match="kept throttling this request \\(5 of 5 attempts") as info:
        list(store.list("manifests/"))
    assert isinstance(info.value, TransientStorageError) and info.value.throttled
    assert store.gave_up == 1
    MemoryStore.clear("throttle-b")


def test_a_repository_on_a_throttled_store_raises_rather_than_finding_no_step():
    import ckptstore
    from ckptstore.repo.repository import Repository

    clock = Clock()
    inner = _Throttling("throttle-c", 10**6)
    repo = Repository(RetryStore(inner, RetryPolicy(max_attempts=3), seed=1, sleep=clock.sleep, monotonic=clock))
    with pytest.raises(StoreThrottledError):
        repo.latest()
    with pytest.raises(StoreThrottledError):
        repo.steps()
    assert ckptstore  # the public package imports the error too
    MemoryStore.clear("throttle-c")


def test_s3_errors_carry_throttled_and_retry_after():
    pytest.importorskip("botocore")
    from botocore.exceptions import ClientError

    from ckptstore.storage.s3 import classify_error

    def err(code, status, headers=None):
        return ClientError({"Error": {"Code": code, "Message": "m"},
                            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers or {}}}, "GetObject")

    e = classify_error(err("SlowDown", 503, {"retry-after": "3"}), "s3://b/k", "GetObject")
    assert isinstance(e, TransientStorageError) and e.throttled and e.retry_after == 3.0
    e = classify_error(err("InternalError", 500), "s3://b/k", "GetObject")
    assert isinstance(e, TransientStorageError) and not e.throttled
    e = classify_error(err("TooManyRequests", 429), "s3://b/k", "GetObject")
    assert e.throttled and e.retry_after is None
    # MinIO answers a conditional create of an existing key with 304 (minio #19442)
    from ckptstore.errors import ObjectExistsError

    assert isinstance(classify_error(err("NotModified", 304), "s3://b/k", "PutObject", exists_on_412=True),
                      ObjectExistsError)
    small = classify_error(err("EntityTooSmall", 400), "s3://b/k", "CompleteMultipartUpload")
    assert type(small) is StorageError and "min_part_size" in str(small) and "part_size" in str(small)


def test_gcs_and_azure_errors_carry_throttled():
    pytest.importorskip("google.auth")
    from ckptstore.storage.gcs import GCSHTTPError
    from ckptstore.storage.gcs import classify_error as gcs_classify

    e = gcs_classify(GCSHTTPError(429, "rateLimitExceeded", retry_after=1.5), "gs://b/k", "objects.get")
    assert e.throttled and e.retry_after == 1.5
    assert not gcs_classify(GCSHTTPError(500, "backend"), "gs://b/k", "objects.get").throttled
    pytest.importorskip("azure.core")
    from azure.core.exceptions import HttpResponseError

    from ckptstore.storage.azure import classify_error as az_classify

    class Resp:
        status_code = 503
        reason = "Server Busy"
        headers = {"x-ms-error-code": "ServerBusy", "Retry-After": "2"}

        def text(self):
            return ""

    exc = HttpResponseError(message="busy", response=Resp())
    exc.status_code = 503
    e = az_classify(exc, "az://c/k", "Get Blob")
    assert isinstance(e, TransientStorageError) and e.throttled and e.retry_after == 2.0


def test_a_minute_without_throttling_turns_the_bucket_off():
    clock = Clock()
    rate = AdaptiveRate(clock=clock, sleep=clock.sleep)
    rate.after(True)
    assert rate.enabled
    clock.t += 30
    rate.before()
    rate.after(False)
    assert rate.enabled  # idle, but throttled 30 s ago
    clock.t += 31
    t0 = clock.t
    for _ in range(100):
        rate.before()
    assert not rate.enabled and clock.t == t0  # the next burst runs at full speed
