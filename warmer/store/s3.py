"""A store in S3 or an S3-compatible service (MinIO, Ceph RGW, R2, GCS interop), through boto3.

    s3://bucket[/prefix]   the same layout as the file store, under prefix

The endpoint is boto3's own (AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, the config file) unless
endpoint_url is given; credentials come only from boto3's default chain and are never printed.
Blobs go up with boto3's transfer manager (multipart, parallel; botocore's per-part checksums on
AWS, and elsewhere only where required, as stores outside AWS refuse or keep its aws-chunked
encoding); index entries with a conditional put (If-None-Match: *), so the first publisher
wins and an entry never changes. Each write is checked against what the store then holds. Reading one artifact costs a GET of its index entry, a HEAD of
its blob and the blob's ranged GETs, however many artifacts the bucket holds.

boto3 is imported here only, when an s3:// store is opened: file stores never pay for it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import random
import threading
import time
import urllib.parse
from contextlib import contextmanager
from typing import Any

from warmer.deadline import Deadline, unbounded
from warmer.errors import Terminated, UsageError
from warmer.store import (
    Blob,
    BlobMissing,
    BlobStream,
    Store,
    StoreError,
    blob_path,
    index_path,
    parse_blob_path,
    parse_index_path,
)
from warmer.store.progress import Progress
from warmer.store.stream import Cut

MiB = 1 << 20
ADDRESSING_ENV = "WARMER_S3_ADDRESSING_STYLE"
# Throttling (503 SlowDown), 500s, resets and timeouts are retried with botocore's standard
# conditions and backoff, 8 attempts in all unless AWS_MAX_ATTEMPTS says otherwise, and never
# past the store's deadline; each retry is one line on the "warmer" logger (_Retries). A body
# cut short mid-stream is asked for again by stream.BlobStream (blobs) or get_index below.
MAX_ATTEMPTS = 8
# botocore's settings of its checksums (Config parameter: environment variable)
CHECKSUM_ENV = {
    "request_checksum_calculation": "AWS_REQUEST_CHECKSUM_CALCULATION",
    "response_checksum_validation": "AWS_RESPONSE_CHECKSUM_VALIDATION",
}
REQUEST_CHECKSUM_ENV = CHECKSUM_ENV["request_checksum_calculation"]
CONFLICT_ATTEMPTS = 5  # S3 answers 409 to a conditional put racing another one: try again


M_ARENA_MAX = -8  # glibc's mallopt parameter


@functools.cache
def cap_malloc_arenas(arenas: int = 2) -> bool:
    """Limit glibc to a few malloc arenas, as MALLOC_ARENA_MAX=2 would, unless the user set it.

    Each of the transfer manager's threads otherwise gets an arena of its own that keeps what it
    freed, and a fetch's memory grew with the artifact (BENCHMARKS.md). warmer is a short-lived
    process that owns its heap, so the setting is made for the whole process, once."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        return ctypes.CDLL(None).mallopt(M_ARENA_MAX, arenas) == 1
    except (OSError, AttributeError):  # not glibc
        return False


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix with a trailing slash or empty) of s3://bucket[/prefix]; UsageError otherwise."""
    import re

    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise UsageError(f"store {url!r} names no bucket: use s3://bucket or s3://bucket/prefix")
    # The characters of S3's bucket names (lowercase letters, digits, '.' and '-', 3 to 63), loosened
    # to '_', capitals and any length up to 63 for S3-compatible stores that allow them.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", bucket):
        raise UsageError(f"store {url!r}: {bucket!r} is not a bucket name: use s3://bucket or s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


_sessions: dict[tuple, Any] = {}
_sessions_lock = threading.Lock()


def _client(endpoint_url: str | None, config):
    """An S3 client. Credentials that refresh themselves (an assumed role: IRSA, an instance or pod
    role) come from one boto3 session per AWS environment, resolved once: fetch --all opened a store
    per recipe, and each assumed the pod's role again, an STS call per recipe per node per round.
    Static keys are read anew each time, as a rotated credentials file must be. Clients are made
    under a lock: a session is not safe to share between threads while it makes them."""
    import boto3
    from botocore.credentials import RefreshableCredentials

    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    with _sessions_lock:
        session = _sessions.get(env)
        if session is None:
            session = boto3.session.Session()
            if isinstance(session.get_credentials(), RefreshableCredentials):
                _sessions[env] = session
        return session.client("s3", endpoint_url=endpoint_url, config=config)


def _on_aws(endpoint: str) -> bool:
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn", ".api.aws"))


def _max_attempts() -> int:
    raw = os.environ.get("AWS_MAX_ATTEMPTS", "")
    if not raw:
        return MAX_ATTEMPTS
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"AWS_MAX_ATTEMPTS={raw!r}: give a whole number of attempts, at least 1")
    return int(raw)


class _Retries:
    """botocore's standard retry conditions and backoff, asked first on every needs-retry event, so
    that a retry never runs past the store's deadline and each one is said (Deadline.retrying)."""

    def __init__(self, store: S3Store, attempts: int):
        from botocore.retries import standard

        self.store, self.attempts = store, attempts
        self._adapter = standard.RetryEventAdapter()
        self._conditions = standard.StandardRetryConditions(max_attempts=attempts)
        self._backoff = standard.ExponentialBackoff()

    def register(self, client) -> None:
        # This handler alone decides retries: botocore's own (the same unique id in every retry
        # mode) would retry past the deadline.
        client.meta.events.unregister("needs-retry.s3", unique_id="retry-config-s3")
        client.meta.events.register_first("needs-retry.s3", self.needs_retry)

    def needs_retry(self, **kwargs):
        """A delay (retry after it), False (the deadline allows none), or None: no error to retry,
        and the other needs-retry handlers answer. One of them is botocore's region redirect: a
        bucket in another region than the client's is answered 301 (or 400), and the request goes
        again, signed for the bucket's region (x-amz-bucket-region)."""
        caught = kwargs.get("caught_exception")
        for e in (caught, getattr(caught, "kwargs", {}).get("error")):
            if isinstance(e, Terminated):  # SIGTERM mid-request, which botocore wraps as a connection error
                raise e
        context = self._adapter.create_retry_context(**kwargs)
        if not self._conditions.is_retryable(context):
            return None
        delay = self._backoff.delay_amount(context)
        deadline = self.store.deadline
        why = _why(context, deadline.read_timeout)
        what = f"{kwargs['operation'].name} s3://{self.store.bucket}"
        if not deadline.allows(delay):
            deadline.note(f"{why} ({what})")
            return False
        deadline.retrying(context.attempt_number + 1, self.attempts, delay, why, what)
        return delay


def _why(context, read_timeout: float) -> str:
    """A retry's cause in a few words: the error code and status, or the connection error."""
    if context.caught_exception is not None:
        e = context.caught_exception
        text = str(e).lower()
        if "read timeout" in text or "timed out" in text:
            return f"{type(e).__name__} after {read_timeout:.0f} s"
        return type(e).__name__
    status = context.http_response.status_code if context.http_response is not None else "?"
    code = context.get_error_code() or ""
    return f"{status} {code}".strip()


class S3Store(Store):
    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        path_style: bool | None = None,
        progress: bool = False,
        part_size: int = 8 * MiB,
        concurrency: int = 8,
        deadline: Deadline | None = None,
    ):
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix.rstrip('/')}" if self.prefix else f"s3://{self.bucket}"
        self.progress = progress
        self.deadline = deadline or unbounded()

        style = "path" if path_style else (os.environ.get(ADDRESSING_ENV) or "").strip() or None
        if style not in (None, "auto", "virtual", "path"):
            raise UsageError(f"{ADDRESSING_ENV}={style!r}: use path, virtual or auto")
        attempts = _max_attempts()
        config = Config(
            retries={"total_max_attempts": attempts},
            connect_timeout=self.deadline.connect_timeout,
            read_timeout=self.deadline.read_timeout,
            max_pool_connections=concurrency + 4,
            s3={"addressing_style": style} if style else None,
        )
        # botocore refuses a blank one (an empty ConfigMap key) with a traceback: unset, as ours are
        unset = [param for param, var in CHECKSUM_ENV.items() if not os.environ.get(var, "").strip()]
        blank = {param: "when_supported" for param in unset if CHECKSUM_ENV[param] in os.environ}
        self._client = _client(endpoint_url, config.merge(Config(**blank)))
        if unset and not _on_aws(self._endpoint()):
            # botocore >= 1.36 wraps uploads in aws-chunked with a CRC32 trailer; S3-compatible
            # stores refuse that (501) or keep the wrapping in the object. warmer hashes every blob.
            self._client = _client(endpoint_url, config.merge(Config(**{param: "when_required" for param in unset})))
        _Retries(self, attempts).register(self._client)
        cap_malloc_arenas()
        self._transfer = TransferConfig(
            multipart_threshold=part_size,
            multipart_chunksize=part_size,
            max_concurrency=concurrency,
            num_download_attempts=5,
        )
        self.part_size, self.concurrency = part_size, concurrency

    # -- errors -------------------------------------------------------------------------------

    def _endpoint(self) -> str:
        return self._client.meta.endpoint_url

    def _message(self, e: Exception, action: str, key: str) -> StoreError:
        """One line that names the problem and the fix; never a credential."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        if isinstance(e, S3UploadFailedError) and isinstance(e.__cause__, ClientError):
            e = e.__cause__
        where = f"s3://{self.bucket}/{key}"
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return StoreError(
                f"no usable AWS credentials for {self.url}: boto3 looks in AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, web identity, and the instance or "
                "pod role; configure one of them"
            )
        if isinstance(e, EndpointConnectionError):
            return StoreError(
                f"cannot reach the S3 endpoint {self._endpoint()}: check --endpoint-url or "
                "AWS_ENDPOINT_URL and the network"
            )
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code, status = err.get("Code", "?"), e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return StoreError(
                    f"bucket {self.bucket} does not exist at {self._endpoint()}: create it, or fix "
                    "the store URL or the endpoint"
                )
            if code in ("RequestTimeTooSkewed", "RequestExpired"):
                return StoreError(
                    f"{self._endpoint()} refused the request as signed at the wrong time ({code}: "
                    f"{err.get('Message', '')}): this machine's clock is off; fix its time sync (NTP, chrony)"
                )
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
                return StoreError(
                    f"{self._endpoint()} rejected the credentials boto3 found ({code}): check "
                    "AWS_PROFILE or AWS_ACCESS_KEY_ID and the secret that goes with it"
                )
            if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
                hint = (
                    " (S3 also answers 403 for a missing object when s3:ListBucket is not granted)"
                    if action == "read"
                    else ""
                )
                said = err.get("Message", "")
                # S3's own words name what was denied beyond the bare phrase (kms:Decrypt, say)
                said = f" ({said})" if said and said.strip(". ").lower() != "access denied" else ""
                return StoreError(
                    f"access denied to {action} {where}{hint}{said}: grant the credentials boto3 found "
                    "s3:GetObject, s3:ListBucket, and to publishers s3:PutObject (gc: "
                    "s3:DeleteObject; rm: both) on the bucket and prefix, and on an SSE-KMS bucket the key's "
                    "kms:Decrypt (publishers: kms:GenerateDataKey)"
                )
            if code == "NotImplemented" or status == 501:
                said = err.get("Message", "")
                if any(w in said.lower() for w in ("chunk", "checksum", "trailer")):
                    fix = f"set {REQUEST_CHECKSUM_ENV}=when_required (warmer does for an endpoint outside AWS unless it is set)"
                else:
                    fix = "warmer needs S3 conditional writes (If-None-Match) to publish safely; upgrade the store"
                return StoreError(
                    f"{self._endpoint()} does not implement what {action} {where} needs ({code}"
                    + (f": {said}" if said else "")
                    + f"): {fix}"
                )
            tries = e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + 1
            after = f" after {tries} attempts" if tries > 1 else ""
            return StoreError(f"{action} {where} failed: {code} {err.get('Message', '')}".rstrip() + after)
        return StoreError(f"{action} {where} failed after retries: {e}")

    def _altered(self, key: str, sent: int, stored: int) -> StoreError:
        return StoreError(
            f"{self._endpoint()} stored s3://{self.bucket}/{key} as {stored} bytes, not the {sent} sent "
            "(deleted again): a store that keeps boto3's aws-chunked upload encoding in the object; set "
            f"{REQUEST_CHECKSUM_ENV}=when_required and publish again"
        )

    @contextmanager
    def _errors(self, action: str, key: str):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError
        from s3transfer import exceptions as transfer

        try:
            yield
        except (
            BotoCoreError,
            ClientError,
            Boto3Error,
            transfer.RetriesExceededError,
            transfer.S3UploadFailedError,
            transfer.S3DownloadFailedError,
        ) as e:
            if self.deadline.gave_up:  # retries stopped for want of time: say the deadline, and why
                raise self.deadline.error(f"{action} s3://{self.bucket}/{key}") from None
            raise self._message(e, action, key) from None

    @staticmethod
    def _code(e) -> tuple[str, int | None]:
        return (
            e.response.get("Error", {}).get("Code", ""),
            e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
        )

    # -- blobs --------------------------------------------------------------------------------

    def has_blob(self, sha256: str) -> bool:
        from botocore.exceptions import ClientError

        key = self.prefix + blob_path(sha256)
        with self._errors("read", key):
            try:
                self._client.head_object(Bucket=self.bucket, Key=key)
                return True
            except ClientError as e:
                if self._code(e)[1] == 404:  # a HEAD has no body: a missing bucket looks the same
                    return False
                raise

    def _upload_blob(self, path: str, sha256: str) -> None:
        key = self.prefix + blob_path(sha256)
        bar = Progress(f"upload {sha256[:12]}", os.path.getsize(path)) if self.progress else None

        def moved(n: int) -> None:  # s3transfer's progress, from its threads: past the deadline, it stops
            if bar:
                bar(n)
            self.deadline.check(f"uploading blob {sha256[:12]} to {self.url}")

        try:
            with self._errors("upload", key):
                self._client.upload_file(
                    path,
                    self.bucket,
                    key,
                    Config=self._transfer,
                    Callback=moved,
                    ExtraArgs={"ContentType": "application/zstd"},
                )
                stored = self._client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        finally:
            if bar:
                bar.close()
        if stored != os.path.getsize(path):
            self.delete_blob(sha256)
            raise self._altered(key, os.path.getsize(path), stored)

    def stream_blob(self, sha256: str, size: int | None = None) -> BlobStream:
        """Ranged GETs of part_size, concurrency at a time, streamed in order to the reader
        (stream.BlobStream). With the index entry's size, the first GETs go out at once (every
        answer's Content-Range must agree with it); without it, a HEAD asks first. botocore
        retries throttling, 5xx and resets before a body; a body cut short is asked for again from
        where it broke off."""
        from botocore.exceptions import ClientError

        key = self.prefix + blob_path(sha256)

        def missing() -> BlobMissing:
            return BlobMissing(
                f"blob {sha256} is missing from {self.url}: the store is damaged or it was "
                "deleted; publish the artifact again"
            )

        total = size
        if total is None:
            with self._errors("read", key):
                try:
                    total = self._client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
                except ClientError as e:
                    if self._code(e)[1] == 404:
                        raise missing() from None
                    raise

        def open_range(start: int, end: int) -> _Body:
            with self._errors("read", key):
                try:
                    got = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")
                except ClientError as e:
                    if self._code(e)[1] == 404:
                        raise missing() from None
                    raise
            if not got.get("ContentRange"):  # 200 and the whole object: it would fill every part with part 1
                got["Body"].close()
                raise StoreError(
                    f"{self.url} answered a ranged GET of blob {sha256[:12]} with the whole object (no "
                    "Content-Range): the endpoint, or a proxy before it, ignores Range, and warmer downloads "
                    "S3 blobs in ranges; point --store at an endpoint that honours Range"
                )
            return _Body(got)

        return BlobStream(
            sha256,
            open_range,
            size=total,
            where=self.url,
            part_size=self.part_size,
            threads=self.concurrency,
            deadline=self.deadline,
        )

    def list_blobs(self) -> list[Blob]:
        return [
            Blob(sha, obj["Size"], obj["LastModified"])
            for rel, obj in self._list("blobs/sha256/")
            if (sha := parse_blob_path(rel))
        ]

    def delete_blob(self, sha256: str) -> None:
        key = self.prefix + blob_path(sha256)
        with self._errors("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=key)

    # -- index --------------------------------------------------------------------------------

    def _create_index(self, rel: str, entry: bytes) -> bool:
        """Create the object only if absent (If-None-Match: *); False: another publisher was first."""
        from botocore.exceptions import ClientError

        obj = self.prefix + rel
        for attempt in range(CONFLICT_ATTEMPTS):
            with self._errors("publish", obj):
                try:
                    self._client.put_object(
                        Bucket=self.bucket, Key=obj, Body=entry, IfNoneMatch="*", ContentType="application/json"
                    )
                except ClientError as e:
                    code, status = self._code(e)
                    if code == "PreconditionFailed" or status == 412:
                        # Also what a retry sees when an earlier attempt of ours landed and its
                        # answer was lost: the entry is then ours, byte for byte.
                        retried = e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0
                        return retried and self._read_index(rel, len(entry) + 1) == entry
                    if code != "ConditionalRequestConflict" and status != 409:
                        raise
                else:
                    stored = self._read_index(rel, len(entry) + 1)
                    if stored != entry:  # ours, and not what was sent: nodes would refuse it
                        self._client.delete_object(Bucket=self.bucket, Key=obj)
                        raise self._altered(obj, len(entry), len(stored or b""))
                    return True
            time.sleep(random.uniform(0, 0.1 * 2**attempt))
        raise StoreError(
            f"publish s3://{self.bucket}/{obj}: still conflicting with another publisher after "
            f"{CONFLICT_ATTEMPTS} tries; publish again"
        )

    def _read_index(self, rel: str, limit: int) -> bytes | None:
        from botocore.exceptions import ClientError, IncompleteReadError, ResponseStreamingError

        obj = self.prefix + rel
        with self._errors("read", obj):
            for attempt in range(1, 4):
                try:
                    body = self._client.get_object(Bucket=self.bucket, Key=obj)["Body"]
                    try:
                        return body.read(limit)  # never more than the cap, whatever the object's size
                    finally:
                        body.close()
                except ClientError as e:
                    if self._code(e)[0] == "NoSuchKey":
                        return None
                    raise
                except (IncompleteReadError, ResponseStreamingError):
                    if attempt == 3:  # the body was cut short every time
                        raise
        return None  # not reached: the last attempt returns or raises (mypy cannot tell)

    def list_index(self, recipe: str | None = None) -> list[tuple[str, str]]:
        under = f"index/{recipe}/" if recipe else "index/"
        return sorted(rk for rel, _ in self._list(under) if (rk := parse_index_path(rel)))

    def delete_index(self, recipe: str, key: str) -> None:
        obj = self.prefix + index_path(recipe, key)
        with self._errors("delete", obj):
            self._client.delete_object(Bucket=self.bucket, Key=obj)

    def _list(self, under: str):
        """(path relative to the prefix, object summary) of every object under prefix/under."""
        with self._errors("list", self.prefix + under):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + under
            )
            return [(obj["Key"][len(self.prefix) :], obj) for page in pages for obj in page.get("Contents", [])]


class _Body:
    """A ranged GetObject's answer, as stream.BlobStream reads it."""

    whole = False

    def __init__(self, got: dict):
        self.body = got["Body"]
        total = (got.get("ContentRange") or "").rpartition("/")[2]
        self.total = int(total) if total.isdigit() else None

    def readinto(self, view) -> int:
        from botocore.exceptions import BotoCoreError
        from urllib3.exceptions import HTTPError

        try:
            # read1: what one read of the connection brings (readinto would wait to fill the view,
            # and a trickle would hold this thread past any stop).
            data = self.body._raw_stream.read1(len(view))
        except (BotoCoreError, HTTPError, OSError) as e:  # a reset, a timeout, a body shorter than its length
            raise Cut(type(e).__name__) from None
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.body.close()
