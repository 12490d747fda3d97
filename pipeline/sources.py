"""Model sources and object-store access: local paths, file://, s3:// and gs:// URIs.

Every stage that reads a model or an engine store goes through here, so a bad URI, a missing
model or an unreachable endpoint is reported the same way everywhere, and fast: S3 clients use
a short connect timeout and no retries by default, because a pipeline step that hangs for minutes
on a typo is worse than one that fails with a message.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from kubetrt.pipeline.errors import PipelineError

SCHEMES = ("file", "s3", "gs")
SAVED_MODEL_PB = "saved_model.pb"

# Fail fast by default (seconds / attempts); override per call or with these environment variables.
S3_CONNECT_TIMEOUT_ENV = "KUBETRT_S3_CONNECT_TIMEOUT"
S3_MAX_ATTEMPTS_ENV = "KUBETRT_S3_MAX_ATTEMPTS"


class SourceError(PipelineError):
    """A model or store URI is malformed, unsupported, missing or unreachable."""


@dataclass(frozen=True)
class Uri:
    """A parsed location: scheme `file` (a local path), `s3` or `gs` (bucket + key prefix)."""

    scheme: str
    bucket: str  # empty for file
    path: str  # local path for file; key prefix without leading/trailing "/" for s3/gs

    def __str__(self) -> str:
        if self.scheme == "file":
            return self.path
        return f"{self.scheme}://{self.bucket}/{self.path}" if self.path else f"{self.scheme}://{self.bucket}"

    def join(self, *parts: str) -> "Uri":
        if self.scheme == "file":
            return Uri("file", "", str(Path(self.path, *parts)))
        key = "/".join(p.strip("/") for p in (self.path, *parts) if p.strip("/"))
        return Uri(self.scheme, self.bucket, key)


def parse_uri(uri: str | os.PathLike[str]) -> Uri:
    """Parse a local path, file://, s3:// or gs:// URI; anything else raises SourceError."""
    text = os.fspath(uri)
    if not text:
        raise SourceError("empty URI: expected a local path, file://PATH, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX")
    if "://" not in text:
        return Uri("file", "", str(Path(text).expanduser()))
    parsed = urlparse(text)
    scheme = parsed.scheme.lower()
    if scheme not in SCHEMES:
        raise SourceError(
            f"{text}: unsupported URI scheme {scheme!r}; expected a local path, file://, s3:// or gs://"
        )
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise SourceError(f"{text}: file:// URIs must name a local absolute path (file:///path), not host {parsed.netloc!r}")
        return Uri("file", "", unquote(parsed.path))
    if not parsed.netloc:
        raise SourceError(f"{text}: {scheme}:// URI has no bucket; expected {scheme}://BUCKET/PREFIX")
    return Uri(scheme, parsed.netloc, unquote(parsed.path).strip("/"))


def model_name_from_uri(uri: str) -> str:
    """The model name a location implies: its last path component, or the one before a TF Serving
    version directory (`models/resnet/1` -> `resnet`). Falls back to "model"."""
    parts = [p for p in parse_uri(uri).path.replace("\\", "/").split("/") if p]
    if parts and parts[-1].isdigit() and len(parts) > 1:
        parts = parts[:-1]
    name = parts[-1] if parts else parse_uri(uri).bucket
    return name or "model"


# ---------------------------------------------------------------------------------------------
# S3


def s3_client(endpoint_url: str | None = None, connect_timeout: float | None = None, max_attempts: int | None = None) -> Any:
    """A boto3 S3 client that fails fast. The endpoint comes from the argument or AWS_ENDPOINT_URL."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    timeout = connect_timeout if connect_timeout is not None else float(os.environ.get(S3_CONNECT_TIMEOUT_ENV, "3"))
    attempts = max_attempts if max_attempts is not None else int(os.environ.get(S3_MAX_ATTEMPTS_ENV, "1"))
    config = Config(
        connect_timeout=timeout,
        read_timeout=max(60.0, timeout),
        retries={"max_attempts": attempts, "mode": "standard"},
        s3={"addressing_style": "path"},
    )
    return boto3.client("s3", endpoint_url=endpoint, config=config)


def s3_error(uri: Uri | str, e: BaseException, client: Any = None) -> SourceError:
    """Translate botocore failures into one line naming the URI, the endpoint and the cause."""
    from botocore import exceptions as bx

    endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None) or "the default AWS endpoint"
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ConnectionClosedError)):
        return SourceError(f"{uri}: cannot reach S3 endpoint {endpoint} ({e}); check AWS_ENDPOINT_URL / --s3-endpoint")
    if isinstance(e, bx.NoCredentialsError):
        return SourceError(f"{uri}: no AWS credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile")
    if isinstance(e, bx.ClientError):
        code = e.response.get("Error", {}).get("Code", "?")
        if code in ("NoSuchBucket", "404", "NoSuchKey"):
            return SourceError(f"{uri}: not found at {endpoint} ({code})")
        return SourceError(f"{uri}: S3 request to {endpoint} failed ({code}: {e})")
    return SourceError(f"{uri}: S3 request to {endpoint} failed ({type(e).__name__}: {e})")


def s3_download_prefix(client: Any, uri: Uri, dest: Path) -> int:
    """Download every object under `uri` into `dest`, keeping relative paths. Returns the file count."""
    from botocore import exceptions as bx

    prefix = uri.path + "/" if uri.path else ""
    count = 0
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                if not rel or rel.endswith("/"):
                    continue
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(uri.bucket, obj["Key"], str(target))
                count += 1
    except (bx.BotoCoreError, bx.ClientError) as e:
        raise s3_error(uri, e, client) from e
    return count


def s3_upload_dir(client: Any, src: Path, uri: Uri, skip: tuple[str, ...] = ()) -> list[str]:
    """Upload every file under `src` to `uri`, returning the relative paths uploaded."""
    from botocore import exceptions as bx

    done: list[str] = []
    try:
        for p in sorted(q for q in src.rglob("*") if q.is_file()):
            rel = p.relative_to(src).as_posix()
            if rel in skip:
                continue
            client.upload_file(str(p), uri.bucket, uri.join(rel).path)
            done.append(rel)
    except (bx.BotoCoreError, bx.ClientError) as e:
        raise s3_error(uri, e, client) from e
    return done


# ---------------------------------------------------------------------------------------------
# Google Cloud Storage


def _gcs_download_prefix(uri: Uri, dest: Path) -> int:
    try:
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage
    except ImportError as e:  # pragma: no cover - depends on the image
        raise SourceError(f"{uri}: gs:// needs the google-cloud-storage package ({e})") from e
    try:
        client = storage.Client.create_anonymous_client() if os.environ.get("STORAGE_EMULATOR_HOST") else storage.Client()
    except DefaultCredentialsError as e:
        raise SourceError(
            f"{uri}: no Google Cloud credentials found; set GOOGLE_APPLICATION_CREDENTIALS or run on a GKE "
            f"node with workload identity ({e.__class__.__name__})"
        ) from e
    prefix = uri.path + "/" if uri.path else ""
    count = 0
    try:
        for blob in client.list_blobs(uri.bucket, prefix=prefix):
            rel = blob.name[len(prefix):]
            if not rel or rel.endswith("/"):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            blob.download_to_filename(str(target))
            count += 1
    except Exception as e:  # google.api_core raises many types; name it and stop
        raise SourceError(f"{uri}: Google Cloud Storage request failed ({type(e).__name__}: {e})") from e
    return count


# ---------------------------------------------------------------------------------------------
# Fetching a model


def fetch_tree(uri: str | Uri, dest: str | os.PathLike[str], *, s3_endpoint: str | None = None) -> Path:
    """Copy the directory tree at `uri` into `dest` (created). Raises SourceError if it is empty/missing."""
    loc = uri if isinstance(uri, Uri) else parse_uri(uri)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if loc.scheme == "file":
        src = Path(loc.path)
        if not src.is_dir():
            raise SourceError(f"{loc}: directory does not exist")
        shutil.copytree(src, dest, dirs_exist_ok=True)
        return dest
    if loc.scheme == "s3":
        client = s3_client(s3_endpoint)
        count = s3_download_prefix(client, loc, dest)
    else:
        count = _gcs_download_prefix(loc, dest)
    if count == 0:
        raise SourceError(f"{loc}: no objects under this prefix (expected a SavedModel directory)")
    return dest


def fetch_model(uri: str, workdir: str | os.PathLike[str], *, s3_endpoint: str | None = None) -> Path:
    """Return a local SavedModel directory for `uri`: local paths as they are, remote ones downloaded.

    Raises SourceError naming the URI when the scheme is unsupported, nothing is there, or the
    directory is not a SavedModel (no saved_model.pb).
    """
    loc = parse_uri(uri)
    if loc.scheme == "file":
        path = Path(loc.path)
        if not path.exists():
            raise SourceError(f"{uri}: model not found (expected a SavedModel directory with {SAVED_MODEL_PB})")
    else:
        path = fetch_tree(loc, Path(workdir) / "savedmodel", s3_endpoint=s3_endpoint)
    if not path.is_dir() or not (path / SAVED_MODEL_PB).is_file():
        raise SourceError(f"{uri}: not a SavedModel (expected a directory containing {SAVED_MODEL_PB})")
    return path
