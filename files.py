"""Files written whole or not at all: what the project writes over while someone may read it, or a kill
may cut short (a drafter and its history, a data set, the converted target, a conformance case).

This module imports no other file of the project.
"""
import hashlib
import os
import shutil
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def replace_files(writes: dict):
    """{path: write}: each write(p) to a file beside its path, and only once all are written each moved into
    place in one step: a reader (a copy taken while training goes on) sees the old file or the new one,
    never half of one, and a run killed while writing leaves the old set whole."""
    parts = {path: path.with_name(path.name + ".part") for path in writes}
    for path, write in writes.items():
        write(parts[path])
    for path, part in parts.items():
        os.replace(part, path)


def replace_file(path: Path, write):
    """replace_files for one file."""
    replace_files({path: write})


def replace_dir(directory: Path, write):
    """write(d) into a sibling dir `<name>.partial`, then moved into place: a run killed while writing
    leaves the old dir whole (the next run removes the sibling). The old dir is renamed aside to
    `<name>.old` before the new one moves in and removed after, so it is never half replaced; a run killed
    between the two renames leaves it there, and the next run puts it back first."""
    partial, old = (directory.with_name(directory.name + suffix) for suffix in (".partial", ".old"))
    if (old.exists() or old.is_symlink()) and not (directory.exists() or directory.is_symlink()):
        old.rename(directory)
    for leftover in (partial, old):   # an earlier run's, killed midway
        remove(leftover)
    write(partial)
    if directory.exists() or directory.is_symlink():
        directory.rename(old)
    partial.rename(directory)
    remove(old)


def foreign_names(directory: Path, owned: set) -> list[str]:
    """The names in directory (none if it is not a dir) that are not in owned: what replace_dir would
    remove with it that its writer does not make."""
    return sorted(p.name for p in directory.iterdir() if p.name not in owned) if directory.is_dir() else []


def remove(path: Path):
    """Remove a dir tree, a file or a link (not what it points to); nothing if there is none."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
