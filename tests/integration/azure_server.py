"""A local Azure Blob Storage server on loopback (Azurite), started and stopped by the tests.

Install: ``npm install --prefix .venv/azurite azurite@3.37.0`` (from the repository root), or
have ``azurite-blob`` on PATH. pyarrow's ``AzureFileSystem`` talks to it with::

    fs = pyarrow.fs.AzureFileSystem(
        account_name=cfg["account_name"], account_key=cfg["account_key"],
        blob_storage_authority=cfg["authority"], blob_storage_scheme="http",
        dfs_storage_authority=cfg["authority"], dfs_storage_scheme="http",
    )
"""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from tests.integration.servers import free_port, server_process

# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
INSTALL_HINT = "npm install --prefix .venv/azurite azurite@3.37.0"

_REPO = Path(__file__).resolve().parents[2]


def azurite_executable() -> str | None:
    """``azurite-blob`` from ``.venv/azurite`` or PATH; None when it is not installed."""
    local = _REPO / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    return shutil.which("azurite-blob")


@contextmanager
def azurite(log: Path, workdir: Path) -> Iterator[dict]:
    """Start ``azurite-blob`` in memory on a free loopback port; yields its connection details.

    The dict has ``account_name``, ``account_key``, ``authority`` ("127.0.0.1:PORT"),
    ``endpoint`` ("http://127.0.0.1:PORT/devstoreaccount1") and ``connection_string``.
    """
    exe = azurite_executable()
    if exe is None:
        raise RuntimeError(
            "azurite-blob is not installed; from the repository root run: " + INSTALL_HINT
        )
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    authority = f"127.0.0.1:{port}"
    endpoint = f"http://{authority}/{AZURITE_ACCOUNT}"
    cmd = [
        exe,
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(port),
        "--inMemoryPersistence",
        "--skipApiVersionCheck",
        "--loose",
        "--disableTelemetry",
    ]

    def is_up() -> bool:
        # An answer, even the refusal of an unsigned request, means it is up.
        with suppress(urllib.error.HTTPError):
            urllib.request.urlopen(f"{endpoint}?comp=list", timeout=1).close()
        return True

    # --inMemoryPersistence refuses --location; stray files land in the working folder.
    with server_process(cmd, log, is_up, "azurite-blob", cwd=workdir):
        yield {
            "account_name": AZURITE_ACCOUNT,
            "account_key": AZURITE_KEY,
            "authority": authority,
            "endpoint": endpoint,
            "connection_string": (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
            ),
        }
