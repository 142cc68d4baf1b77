"""What a store's error means (missing bucket, rejected credentials, no permission, an
endpoint that cannot be reached), read from the texts pyarrow's S3, GCS and Azure clients
raise, for messages that say the cause.
"""

from __future__ import annotations

import re

from raytrain.errors import one_line

DENIED = "access denied (no permission)"
# What the stores' error texts mean, for messages that say the cause: (markers, cause).
_CAUSES = (
    (
        (
            "INVALID_ACCESS_KEY_ID",
            "SIGNATURE_DOES_NOT_MATCH",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AuthenticationFailed",
            "InvalidToken",
            "EXPIRED_TOKEN",
            "ExpiredToken",
            "Unauthorized",
            401,
        ),
        "the credentials were rejected",
    ),
    (
        (
            "ACCESS_DENIED",
            "AccessDenied",
            "AuthorizationPermissionMismatch",
            "AuthorizationFailure",
            "Forbidden",
            403,
        ),
        DENIED,
    ),
    (
        (
            "NETWORK_CONNECTION",
            "Could not connect",
            "Couldn't connect",
            "Connection refused",
            "curlCode: 7",
            "curlCode: 28",
            "timed out",
            "Timeout",
            "Could not resolve",
            "Failed to connect",
        ),
        "the endpoint cannot be reached",
    ),
    (
        ("NO_SUCH_BUCKET", "NoSuchBucket", "ContainerNotFound", "bucket does not exist"),
        "the bucket does not exist",
    ),
)


def cause(exc: BaseException) -> str | None:
    """What a storage error means (missing bucket, rejected credentials ...), if known.

    A marker that is a number (an HTTP status) matches only as a number of its own: the
    port in "Failed to connect to 127.0.0.1 port 40111" is no 401."""
    text = str(exc)
    numbers = set(re.findall(r"\d+", text))
    for markers, meaning in _CAUSES:
        if any(str(m) in numbers if isinstance(m, int) else m in text for m in markers):
            return meaning
    return None


def describe(exc: BaseException) -> str:
    """A storage error as one line: its cause, if known, and the store's own words."""
    detail = one_line(exc)
    meaning = cause(exc)
    return f"{meaning} ({detail})" if meaning else detail
