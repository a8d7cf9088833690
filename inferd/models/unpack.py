"""A model shipped as a .zip, unpacked once into $INFERD_CACHE_DIR/unpacked/<sha256 of the zip>/.

The entry appears atomically (unpacked aside, then renamed), so a crash mid-way leaves nothing that looks
complete, and two processes unpacking the same zip at once both end with the same directory.
"""
import hashlib
import logging
import os
import shutil
import zipfile
from pathlib import Path

from inferd.models.errors import ModelLoadError

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


def unpack_root() -> Path:
    return Path(os.environ.get("INFERD_CACHE_DIR") or Path.home() / ".cache" / "inferd") / "unpacked"


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def unpacked_dir(zip_path: Path) -> Path:
    """The directory holding zip_path's files (the zip's single top folder, if it has one)."""
    target = unpack_root() / file_sha256(zip_path)
    if not target.is_dir():
        _unpack(zip_path, target)
    return _content_root(target)


def _unpack(zip_path: Path, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(zip_path) as archive:
            _check_members(archive, zip_path)
            archive.extractall(tmp)
        tmp.rename(target)  # fails if another process got there first: theirs is as good
        log.info("unpacked %s into %s", zip_path, target)
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{zip_path} is not a readable zip ({exc}); reinstall or re-download it") from exc
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_members(archive: zipfile.ZipFile, zip_path: Path) -> None:
    for name in archive.namelist():
        if name.startswith("/") or ".." in Path(name).parts:
            raise ModelLoadError(f"{zip_path} holds a path outside its folder ({name!r}); refusing to unpack it")


def _content_root(target: Path) -> Path:
    entries = [p for p in target.iterdir() if not p.name.startswith(".")]
    if len(entries) == 1 and entries[0].is_dir() and not (target / "config.json").exists():
        return entries[0]
    return target
