"""Quotas on the Files API: how many files and bytes the store holds, in all and per caller.

A caller is an API key (``key-`` and a short hash of it, never the key itself) or ``anonymous`` when
the service has no key. Uploads count against their caller; batch output files only against the
totals. An upload past a quota gets a 409 naming the quota, so a client knows to delete files first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from xservice.http.errors import ConflictError

ANONYMOUS = "anonymous"


class FileQuotaError(ConflictError):
    """An upload would exceed a files quota (409, ``file_quota_exceeded``)."""

    default_code = "file_quota_exceeded"


@dataclass(frozen=True)
class FileQuota:
    """The limits (``BatchConfig``'s ``max_files``, ``max_total_file_bytes``, ``*_per_caller``)."""

    max_files: int
    max_bytes: int
    max_files_per_caller: int
    max_bytes_per_caller: int


@dataclass(frozen=True)
class FileUsage:
    """Files and their bytes, now."""

    num_files: int = 0
    num_bytes: int = 0


def caller_id(authorization: str | None, auth_enabled: bool) -> str:
    """Who owns an upload: a hash of the bearer token when the service checks API keys."""
    if not auth_enabled:
        return ANONYMOUS
    token = (authorization or "").partition(" ")[2].strip()
    return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]


def check_quota(quota: FileQuota, total: FileUsage, mine: FileUsage, size: int) -> None:
    """Raise ``FileQuotaError`` if one more file of ``size`` bytes passes a limit."""
    limits = (
        (total.num_files + 1, quota.max_files, "files in the store", "batch.max_files"),
        (total.num_bytes + size, quota.max_bytes, "bytes in the store", "batch.max_total_file_bytes"),
        (
            mine.num_files + 1,
            quota.max_files_per_caller,
            "files of this caller",
            "batch.max_files_per_caller",
        ),
        (
            mine.num_bytes + size,
            quota.max_bytes_per_caller,
            "bytes of this caller",
            "batch.max_file_bytes_per_caller",
        ),
    )
    for wanted, limit, what, name in limits:
        if wanted > limit:
            raise FileQuotaError(
                f"Files quota exceeded: this upload would make {wanted} {what}, over the limit of {limit} "
                f"({name}); delete files (DELETE /v1/files/{{file_id}}) first.",
                param="file",
            )
