"""Atomic, verified, pickle-free checkpoints.

A checkpoint is a folder ``step_00000123/`` under the save directory:

    shared.npz        arrays every rank holds alike (model, optimizer state), written by rank 0
    rank_00003.npz    each rank's own arrays (sampler position, RNG state, residuals, ...)
    manifest.json     step, world size, and for every file its SHA-256, byte count and the
                      shape and dtype of every array in it — written last, by rank 0
and ``latest`` names the newest complete folder. Every file is written to a temporary name,
fsync'ed and renamed, so a crash leaves either the old checkpoint or the new one, never half of
one. Loading reads the manifest, checks each file's checksum and each array's shape and dtype,
and names the bad file in its error. Arrays are stored with ``np.savez`` and read with
``allow_pickle=False``; JSON-able values (RNG states) travel as UTF-8 bytes in an array.
"""
from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)                         # the rename itself is durable
    finally:
        os.close(dir_fd)


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


def save(save_dir: str, step: int, comm, shared: dict, own: dict, meta: dict | None = None) -> str:
    """Write a checkpoint collectively; return its folder.

    ``shared``: arrays identical on every rank (rank 0 writes them); ``own``: this rank's.
    """
    folder = step_dir(save_dir, step)
    if comm.rank == 0:
        os.makedirs(folder, exist_ok=True)
    comm.barrier()                               # the folder exists before anyone writes
    own_name = f"rank_{comm.rank:05d}.npz"
    own_bytes = _npz_bytes(own)
    _write_atomic(os.path.join(folder, own_name), own_bytes)
    digest = np.frombuffer(hashlib.sha256(own_bytes).digest(), dtype=np.uint8).copy()
    sizes = np.array([len(own_bytes)], dtype=np.int64)
    digests = comm.allgather(digest).reshape(comm.size, 32)
    all_sizes = comm.allgather(sizes)
    if comm.rank == 0:
        shared_bytes = _npz_bytes(shared)
        _write_atomic(os.path.join(folder, "shared.npz"), shared_bytes)
        files = {"shared.npz": {"sha256": hashlib.sha256(shared_bytes).hexdigest(),
                                "bytes": len(shared_bytes), "arrays": _describe(shared)}}
        own_arrays = _describe(own)   # every rank stores the same keys, shapes may differ
        for r in range(comm.size):
            files[f"rank_{r:05d}.npz"] = {"sha256": bytes(digests[r]).hex(),
                                          "bytes": int(all_sizes[r]),
                                          "arrays": own_arrays if r == 0 else None}
        manifest = {"format": "hpcdist-checkpoint-1", "step": step, "world": comm.size,
                    "meta": meta or {}, "files": files}
        _write_atomic(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())
        _write_atomic(os.path.join(save_dir, LATEST), os.path.basename(folder).encode())
    comm.barrier()                               # complete on disk before anyone goes on
    return folder


def latest(save_dir: str) -> str | None:
    """The newest complete checkpoint folder in ``save_dir`` (None if there is none)."""
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    folder = os.path.join(save_dir, name)
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        raise CheckpointError(f"{path} names {name!r}, which has no {MANIFEST}")
    return folder


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
    mpath = os.path.join(folder, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{mpath}: missing — not a complete checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mpath}: not valid JSON ({e})") from None
    if manifest.get("world") != comm.size:
        raise CheckpointError(f"{mpath}: written by {manifest.get('world')} ranks, resuming on "
                              f"{comm.size}; resume with the same number of ranks")
    files = manifest["files"]
    shared = _read_verified(folder, "shared.npz", files["shared.npz"])
    own_name = f"rank_{comm.rank:05d}.npz"
    own = _read_verified(folder, own_name, files[own_name])
    return manifest, shared, own
