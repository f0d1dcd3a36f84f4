"""Atomic, verified, pickle-free checkpoints.

A checkpoint is a folder ``step_00000123/`` under the save directory:

    shared.npz        arrays every rank holds alike (model, optimizer state), written by rank 0
    rank_00003.npz    each rank's own arrays (sampler position, RNG state, residuals, ...)
    manifest.json     step, world size, and for every file its SHA-256, byte count and the
                      shape and dtype of every array in it — written last, by rank 0
and ``latest`` names the newest complete folder. Every file is written to a temporary name,
fsync'ed and renamed, so a crash leaves either the old checkpoint or the new one, never half of
one. A save that fails on any rank (disk full, permission, quota) fails on every rank: the
ranks agree, remove what the new checkpoint had written, keep ``latest`` where it was, and
raise ``CheckpointError`` naming the rank and the path. Loading reads the manifest, checks
each file's checksum and each array's shape and dtype, and names the bad file in its error.
``find_resume`` falls back to the newest checkpoint that verifies when ``latest`` is missing
or damaged, and says so; it never starts over where checkpoints exist. Arrays are stored with ``np.savez`` and read with
``allow_pickle=False``; JSON-able values (RNG states) travel as UTF-8 bytes in an array.
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import shutil

import numpy as np

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _quiet():
            os.remove(tmp)                       # never leave a temporary that fills the disk
        raise
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)                         # the rename itself is durable
    finally:
        os.close(dir_fd)


def write_json_atomic(path: str, value) -> None:
    _write_atomic(path, json.dumps(value, indent=1).encode())


def json_array(value) -> np.ndarray:
    """A JSON-able value as a uint8 array (stored without pickle)."""
    return np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)


def from_json_array(arr: np.ndarray):
    return json.loads(bytes(np.asarray(arr, dtype=np.uint8)).decode())


def _npz_bytes(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    return buf.getvalue()


def _describe(arrays: dict) -> dict:
    return {k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)}
            for k, v in arrays.items()}


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step_{step:08d}")


class _quiet:
    """Ignore OSError (cleanup of what may not exist)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is not None and issubclass(kind, OSError)


def _agree_failure(comm, error: str | None) -> str | None:
    """Every rank learns whether any rank failed; returns the lowest failing rank's message."""
    flag = comm.allreduce(np.array([comm.size - comm.rank if error else 0], dtype=np.int64),
                          op="max")
    if not flag[0]:
        return None
    reporter = comm.size - int(flag[0])
    text = np.zeros(1024, dtype=np.uint8)
    if comm.rank == reporter:
        raw = f"rank {reporter}: {error}".encode()[:1024]
        text[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    comm.bcast(text, root=reporter)
    return bytes(text).rstrip(b"\0").decode(errors="replace")


def _oserror(e: OSError, path: str) -> str:
    return f"{e.filename or path}: {e.strerror or e}"


def save(save_dir: str, step: int, comm, shared: dict, own: dict, meta: dict | None = None) -> str:
    """Write a checkpoint collectively; return its folder.

    ``shared``: arrays identical on every rank (rank 0 writes them); ``own``: this rank's.
    Raises CheckpointError on every rank if writing failed on any (see the module doc).
    """
    folder = step_dir(save_dir, step)
    existed = os.path.isdir(folder)
    own_path = os.path.join(folder, f"rank_{comm.rank:05d}.npz")
    error = None
    if comm.rank == 0:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            error = _oserror(e, folder)
    error = _agree_failure(comm, error)          # the folder exists before anyone writes
    own_bytes = b""
    if error is None:
        try:
            own_bytes = _npz_bytes(own)
            _write_atomic(own_path, own_bytes)
        except OSError as e:
            error = _oserror(e, own_path)
        error = _agree_failure(comm, error)
    if error is None:
        digest = np.frombuffer(hashlib.sha256(own_bytes).digest(), dtype=np.uint8).copy()
        digests = comm.allgather(digest).reshape(comm.size, 32)
        all_sizes = comm.allgather(np.array([len(own_bytes)], dtype=np.int64))
        if comm.rank == 0:
            try:
                _write_shared(save_dir, folder, step, comm.size, shared, own, meta, digests,
                              all_sizes)
            except OSError as e:
                error = _oserror(e, folder)
        error = _agree_failure(comm, error)      # complete on disk before anyone goes on
    if error is None:
        return folder
    with _quiet():
        os.remove(own_path)
    comm.barrier()
    if comm.rank == 0 and not existed:
        shutil.rmtree(folder, ignore_errors=True)
    kept = _latest_name(save_dir)
    raise CheckpointError(f"saving checkpoint step {step} failed on {error}; "
                          + (f"the previous checkpoint ({kept}) is still 'latest'" if kept
                             else "no earlier checkpoint exists")
                          + " and nothing of the failed one is left")


def _write_shared(save_dir, folder, step, world, shared, own, meta, digests, all_sizes) -> None:
    """Rank 0: shared.npz, then the manifest, then ``latest`` (each atomically)."""
    shared_bytes = _npz_bytes(shared)
    _write_atomic(os.path.join(folder, "shared.npz"), shared_bytes)
    files = {"shared.npz": {"sha256": hashlib.sha256(shared_bytes).hexdigest(),
                            "bytes": len(shared_bytes), "arrays": _describe(shared)}}
    own_arrays = _describe(own)   # every rank stores the same keys, shapes may differ
    for r in range(world):
        files[f"rank_{r:05d}.npz"] = {"sha256": bytes(digests[r]).hex(),
                                      "bytes": int(all_sizes[r]),
                                      "arrays": own_arrays if r == 0 else None}
    manifest = {"format": "hpcdist-checkpoint-1", "step": step, "world": world,
                "meta": meta or {}, "files": files}
    _write_atomic(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())
    _write_atomic(os.path.join(save_dir, LATEST), os.path.basename(folder).encode())


def _latest_name(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def latest(save_dir: str) -> str | None:
    """The folder ``latest`` names in ``save_dir`` (None if there is no ``latest``)."""
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    name = _latest_name(save_dir)
    folder = os.path.join(save_dir, name or "")
    if not name or not os.path.isfile(os.path.join(folder, MANIFEST)):
        raise CheckpointError(f"{path} names {name!r}, which has no {MANIFEST}")
    return folder


def read_manifest(folder: str) -> dict:
    """The manifest of a checkpoint folder, checked for the fields every loader needs."""
    mpath = os.path.join(folder, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{mpath}: missing — not a complete checkpoint") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{mpath}: not a checkpoint manifest (a JSON object expected)")
    for key, kind in (("step", int), ("world", int), ("files", dict)):
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{mpath}: the manifest has no valid {key!r}; the checkpoint "
                                  "is damaged or was not written by hpcdist")
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("bytes"), int)):
            raise CheckpointError(f"{mpath}: the entry for {name!r} has no sha256/bytes")
    return manifest


def verify(folder: str) -> dict:
    """Check every file of a checkpoint against its manifest; return the manifest."""
    manifest = read_manifest(folder)
    for name, entry in manifest["files"].items():
        _read_verified(folder, name, entry)
    return manifest


def find_resume(save_dir: str) -> tuple[str | None, str]:
    """(folder to resume from or None, what was decided, in words).

    ``latest`` when its checkpoint verifies; else the newest ``step_*`` folder that does
    (said in the note); None only where ``save_dir`` holds no checkpoint at all. Raises
    CheckpointError where checkpoints exist and none verifies: never starts over silently.
    """
    steps = sorted(glob.glob(os.path.join(save_dir, "step_*")), reverse=True)
    name = _latest_name(save_dir)
    if name is None and not steps:
        return None, f"no checkpoint in {save_dir}: starting at step 0"
    problems = []
    if name is not None:
        folder = os.path.join(save_dir, name)
        try:
            verify(folder)
            return folder, f"resuming from {folder} ('latest')"
        except CheckpointError as e:
            problems.append(f"'latest' -> {name}: {e}")
    else:
        problems.append(f"{os.path.join(save_dir, LATEST)} is missing")
    for folder in steps:
        if name is not None and os.path.basename(folder) == name:
            continue
        try:
            verify(folder)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        return folder, (f"resuming from {folder}, the newest checkpoint that verifies ("
                        + "; ".join(problems) + ")")
    raise CheckpointError(f"--resume: no checkpoint in {save_dir} verifies: "
                          + "; ".join(problems) + ". Refusing to start over; remove the "
                          "folder or point --save-dir elsewhere to start a new run")


def _read_verified(folder: str, name: str, entry: dict) -> dict:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (the manifest lists it)")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch — the file is corrupt or was changed "
                              "after the checkpoint was written; resume from an older one")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    for key, desc in (entry.get("arrays") or {}).items():
        if key not in arrays:
            raise CheckpointError(f"{path}: array {key!r} is missing")
        a = arrays[key]
        if name == "shared.npz" and (list(a.shape) != desc["shape"] or str(a.dtype) != desc["dtype"]):
            raise CheckpointError(f"{path}: array {key!r} is {a.dtype}{list(a.shape)}, the "
                                  f"manifest says {desc['dtype']}{desc['shape']}")
    return arrays


def load(folder: str, comm) -> tuple[dict, dict, dict]:
    """(manifest, shared arrays, this rank's arrays) of a checkpoint, every file verified."""
    manifest = read_manifest(folder)
    mpath = os.path.join(folder, MANIFEST)
    if manifest["world"] != comm.size:
        raise CheckpointError(f"{mpath}: written by {manifest['world']} ranks, resuming on "
                              f"{comm.size}; resume with the same number of ranks")
    files = manifest["files"]
    own_name = f"rank_{comm.rank:05d}.npz"
    for name in ("shared.npz", own_name):
        if name not in files:
            raise CheckpointError(f"{mpath}: the manifest lists no {name}")
    shared = _read_verified(folder, "shared.npz", files["shared.npz"])
    own = _read_verified(folder, own_name, files[own_name])
    return manifest, shared, own


def check_meta(manifest: dict, meta: dict, folder: str) -> None:
    """Refuse, in one line, a checkpoint written by a run that differs from this one."""
    saved = manifest.get("meta") or {}
    diffs = [f"{k} {saved[k]!r} there, {v!r} here" for k, v in meta.items()
             if k in saved and saved[k] != v]
    if diffs:
        raise CheckpointError(f"{folder} was written by a different run: " + "; ".join(diffs)
                              + ". Resume with the same settings, or use another --save-dir")
