"""The ``storage`` section: how raytrain reaches S3, GCS and Azure (endpoints, retries,
timeouts), never credentials."""

from __future__ import annotations

from pydantic import (
    Field,
    field_validator,
)

from raytrain.spec.fields import (
    _check_endpoint,
    _Section,
)
from raytrain.storage.filesystems import DEFAULT_ATTEMPTS


class _EndpointSection(_Section):
    """A store's options; its ``endpoint_url`` is checked to be a URL without credentials."""

    @field_validator("endpoint_url", check_fields=False)
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        return _check_endpoint(value)


class S3Options(_EndpointSection):
    endpoint_url: str | None = Field(
        default=None,
        description="An S3-compatible endpoint (MinIO, Ceph, a test server), e.g. "
        "`http://127.0.0.1:9000`; default: `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`, else AWS.",
    )
    region: str | None = Field(
        default=None,
        description="The buckets' region; default: `AWS_REGION`/`AWS_DEFAULT_REGION`, else "
        "looked up from the bucket.",
    )


class GcsOptions(_EndpointSection):
    endpoint_url: str | None = Field(
        default=None,
        description="A GCS-compatible endpoint (an emulator), e.g. `http://127.0.0.1:4443`; "
        "default: `STORAGE_EMULATOR_HOST`, else Google Cloud Storage.",
    )
    project_id: str | None = Field(default=None, description="Project that new buckets go to.")


class AzureOptions(_EndpointSection):
    account_name: str | None = Field(
        default=None,
        description="The storage account; default: the URI's `container@account...` part, "
        "else `AZURE_STORAGE_ACCOUNT_NAME`.",
    )
    endpoint_url: str | None = Field(
        default=None,
        description="A Blob endpoint other than Azure's (Azurite), e.g. `http://127.0.0.1:10000`;"
        " default: from `AZURE_STORAGE_CONNECTION_STRING`, else Azure.",
    )


class StorageSpec(_Section):
    """Where object stores are and how requests to them are retried. Credentials are never
    part of a spec: they come from each provider's standard chain."""

    s3: S3Options = Field(default_factory=S3Options, description="S3 and S3-compatible stores.")
    gcs: GcsOptions = Field(default_factory=GcsOptions, description="Google Cloud Storage.")
    azure: AzureOptions = Field(default_factory=AzureOptions, description="Azure Blob Storage.")
    max_attempts: int = Field(
        default=DEFAULT_ATTEMPTS,
        ge=1,
        le=20,
        description="Attempts per request: transient faults (connection errors, 5xx, "
        "throttling) are retried with exponential backoff; 403/404 are not.",
    )
