"""Staged publication: an artifact appears whole under its final name, or not at all.

Every writer stages into a private sibling path in the destination's folder and publishes by one
atomic step. A failed writer leaves nothing behind and never touches an existing destination.
"""
import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ArtifactError


def refuse_existing(dst) -> Path:
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        raise ArtifactError(f"destination {str(dst)!r} already exists; published artifacts never "
                            "overwrite: choose a new path")
    if not dst.parent.is_dir():
        raise ArtifactError(f"folder {str(dst.parent)!r} for {str(dst)!r} does not exist; create it first")
    return dst


@contextlib.contextmanager
def staged_file(dst):
    """Yield a temporary path beside `dst`; on success hard-link it to `dst` (fails if `dst` appeared)."""
    dst = refuse_existing(dst)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        _fsync(tmp)
        try:
            os.link(tmp, dst)  # atomic and refuses an existing name, unlike rename
        except FileExistsError:
            raise ArtifactError(f"destination {str(dst)!r} appeared while writing; nothing was changed") from None
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_dir(dst):
    """Yield a temporary folder beside `dst`; on success rename it to `dst`."""
    dst = refuse_existing(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        if dst.exists():
            raise ArtifactError(f"destination {str(dst)!r} appeared while writing; nothing was changed")
        os.rename(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256_file(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
