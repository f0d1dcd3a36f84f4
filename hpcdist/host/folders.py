"""Folders hpcdist did not make are not written into: a save folder, ``prepare --out`` or an
export target that holds a file hpcdist does not write there is refused before anything is
written, naming one such file (``--allow-other-files`` writes anyway). Each writer states the
names it writes (``ours``); everything else in the folder is someone else's."""
from __future__ import annotations

import fnmatch
import os

FLAG = "--allow-other-files"


def other_file(folder: str, ours, allowed=()) -> str | None:
    """The first entry of ``folder`` (sorted) that matches none of the glob patterns ``ours``
    and neither is nor holds one of the paths ``allowed`` (files the user named: a corpus
    beside its shards); None when there is none, or the folder does not exist."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return None
    allowed = {head for p in allowed for head in _heads(os.path.realpath(p))}
    for name in names:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in ours):
            continue
        if os.path.realpath(os.path.join(folder, name)) in allowed:
            continue
        return name
    return None


def _heads(path: str):
    """``path`` and every folder above it."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def refusal(folder: str, what: str, ours, allowed=()) -> str | None:
    """The one-line refusal of writing ``what`` into ``folder`` (None: nothing in the way)."""
    name = other_file(folder, ours, allowed)
    if name is None:
        return None
    kind = "folder" if os.path.isdir(os.path.join(folder, name)) else "file"
    return (f"{what} {folder!r} holds files hpcdist did not write there (the {kind} {name!r}): "
            f"pass an empty or new folder, or {FLAG} to write among them")


def inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (real paths: links resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
