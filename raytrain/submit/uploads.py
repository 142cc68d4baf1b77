"""What a submitted job's working dir upload leaves out: Ray's own rules, raytrain's
(``WORKING_DIR_EXCLUDES``) and every secret-shaped name (``SECRET_EXCLUDES``), and no link
out of the directory."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Where a job server is found when no address is given: Ray's own variables for its CLI.
from raytrain.submit.connection import JobsError

# Never sent with a working directory, on top of what its .gitignore leaves out.
WORKING_DIR_EXCLUDES = [".git", ".venv", "__pycache__", "*.egg-info"]

# Secret-shaped names, never sent either (and named when left out). Gitignore syntax, the way
# Ray's ``excludes`` reads it: a name without a slash matches at any depth, and the last line
# that matches wins. The first two lines match names that hold a secret only sometimes, so the
# next two let Python files and a tokenizer's files back in (``tokenizer.json``,
# ``credentials.py``) before the names that always hold one. OpenSSH's key files are named by
# type (``id_*`` would also take ``id_to_label.json``).
SECRET_EXCLUDES = [
    "*token*",
    "credentials*",
    "!*.py",
    "!*tokeniz*",
    "!*tokeniz*/**",
    ".env*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.jks",
    "*.keystore",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "id_xmss*",
    ".aws",
    ".ssh",
    ".gnupg",
    ".azure",
    ".kube",
    "**/.config/gcloud",
    ".netrc",
    ".pgpass",
    ".git-credentials",
    ".docker/config.json",
    "*.db",
    "*.sqlite",
    "*.sqlite3",
]


def upload_excludes(root: Path, include: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(Ray's ``excludes`` for uploading the working dir ``root``, the paths left out of it
    for a secret-shaped name, relative to ``root``, folders with a trailing ``/``).

    The walk skips what Ray's own defaults, ``WORKING_DIR_EXCLUDES`` and the ``.gitignore``
    and ``.rayignore`` files leave out, with Ray's own matching, so it sees what Ray would
    upload. Ray follows symbolic links and uploads what they point at: a link that resolves
    outside ``root`` is refused (``JobsError``, naming it), and one that leads to a
    secret-shaped file inside it is left out. ``include``: gitignore patterns sent although
    they look secret (``tokens.txt``).
    """
    secret = [*SECRET_EXCLUDES, *(f"!{pattern}" for pattern in include)]
    walk = _UploadWalk(root, secret)
    walk.folder(root, [])
    if walk.outside:
        raise JobsError(
            [
                f"--working-dir {root}: {link} is a symbolic link out of the working dir; "
                "Ray would upload what it points at (remove the link, copy what the job "
                "needs into the working dir, or list the link in .rayignore)"
                for link in walk.outside
            ]
        )
    return [*WORKING_DIR_EXCLUDES, *secret, *walk.links], walk.left_out


class _UploadWalk:
    """The working dir as Ray's upload sees it, and what of it is secret-shaped."""

    def __init__(self, root: Path, secret: list[str]):
        from raytrain._compat.ray_core import upload_matchers

        self.root = root
        self.rules = upload_matchers()
        base = [*self.rules.default_excludes, *WORKING_DIR_EXCLUDES]
        self.ignored = self.rules.path_spec.from_lines("gitwildmatch", base)
        self.excluded = self.rules.path_spec.from_lines("gitwildmatch", [*base, *secret])
        self.quiet = logging.getLogger("raytrain.upload")  # Ray logs each ignore file it reads
        self.quiet.setLevel(logging.WARNING)
        self.left_out: list[str] = []  # secret-shaped paths, left out
        self.links: list[str] = []  # excludes for links to secret-shaped files
        self.outside: list[str] = []  # links out of the working dir

    def folder(
        self, folder: Path, ignores: list[Any], chain: frozenset[Path] = frozenset()
    ) -> None:
        """Walk ``folder`` (``chain``: the real folders this walk is inside, so a link to one
        of them, a loop, is not walked again)."""
        chain = chain | {folder.resolve()}
        found = self.rules.excludes_from_ignore_files(
            folder, self.rules.reads_gitignore, logger=self.quiet
        )
        ignores = [*ignores, *found]
        try:
            children = sorted(folder.iterdir())
        except OSError as exc:
            raise JobsError(f"--working-dir: cannot list {folder} ({exc.strerror})") from None
        for path in children:
            rel = path.relative_to(self.root).as_posix()
            if self.ignored.match_file(rel) or any(ignore(path) for ignore in ignores):
                continue
            if self.excluded.match_file(rel):
                folder_mark = "/" if path.is_dir() and not path.is_symlink() else ""
                self.left_out.append(rel + folder_mark)
            elif path.is_symlink():
                self.link(path, rel, ignores, chain)
            elif path.is_dir():
                self.folder(path, ignores, chain)

    def link(self, path: Path, rel: str, ignores: list[Any], chain: frozenset[Path]) -> None:
        target = path.resolve()
        if not target.exists():
            return  # Ray uploads nothing for a dangling link
        if not target.is_relative_to(self.root):
            self.outside.append(f"{rel} -> {target}")
        elif self.excluded.match_file(target.relative_to(self.root).as_posix()):
            self.left_out.append(f"{rel} (a link to {target.relative_to(self.root).as_posix()})")
            self.links.append("/" + self.rules.escape(rel))
        elif target.is_dir() and target not in chain:
            # Ray uploads a linked folder's files under the link's path, whatever ignores
            # the folder where it really is: walked as Ray sees it
            self.folder(path, ignores, chain)
