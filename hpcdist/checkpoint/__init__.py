"""Layout-free, atomic, verified, pickle-free checkpoints.

A checkpoint is a folder ``step_00000123/`` under the save directory — the list goes on in
docs/checkpoints.md, "hpcdist/checkpoint/__init__.py"."""
from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np

from . import reshard
from .agree import agree_failure, gather_json
from .errors import CheckpointError
from .meta import check_meta, checkpoint_meta  # noqa: F401  (checkpoint.check_meta, ...)

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "hpcdist-checkpoint-2"


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)                       # never leave a temporary that fills the disk
        raise
    _fsync_dir(os.path.dirname(path))


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


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step_{step:08d}")


PARTIAL = "partial."                             # a save being written: partial.step_00000123


def _fsync_dir(path: str) -> None:                # a rename in it is durable
    dir_fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _oserror(e: OSError, path: str) -> str:
    return f"{e.filename or path}: {e.strerror or e}"


def save(save_dir: str, step: int, comm, pieces: list, own: dict, meta: dict | None = None,
         *, scalars: dict | None = None) -> str:
    """Write a checkpoint collectively; return its folder.

    ``pieces``: [(name, cut, logical shape, (a, b), array)] this rank writes (reshard.py);
    ``own``: this rank's own arrays; ``scalars``: JSON values, the same on every rank (rank 0's
    are kept). Raises CheckpointError on every rank if writing failed on any. The three
    phases (``begin``, ``write_file``, ``publish``) are also run apart: checkpoint/background.py
    writes the file off the step's path.
    """
    started = begin(save_dir, step, comm, pieces, own)
    if started.error is None:
        started.digest, started.error = write_file(started.path, started.arrays)
    return publish(started, comm, meta, scalars)


@dataclass
class Started:
    """A save begun on this rank: its stage folder (made by rank 0, agreed), this rank's file
    and arrays, the pieces' descriptions; ``digest`` and ``error`` once the file is written."""
    save_dir: str
    step: int
    stage: str
    name: str
    path: str
    arrays: dict
    described: list
    error: str | None = None
    digest: dict | None = None


def begin(save_dir: str, step: int, comm, pieces: list, own: dict, copy=None) -> Started:
    """The save's first phase (collective): rank 0 makes the stage folder, every rank learns
    whether it could; ``copy(key, array)``: each array's copy in host memory (the state goes
    on changing while a background thread writes them), None to keep the arrays as given."""
    folder = step_dir(save_dir, step)
    stage = os.path.join(save_dir, PARTIAL + os.path.basename(folder))
    name = f"rank_{comm.rank:05d}.npz"
    error = None
    if comm.rank == 0:
        try:
            shutil.rmtree(stage, ignore_errors=True)     # what an interrupted save left
            os.makedirs(stage)
        except OSError as e:
            error = _oserror(e, stage)
    error = agree_failure(comm, error)          # the folder exists before anyone writes
    keep = copy or (lambda key, a: a)
    arrays = {f"p{i}": keep(f"p{i}", data) for i, (_, _, _, _, data) in enumerate(pieces)}
    arrays.update({f"own/{k}": keep(f"own/{k}", v) for k, v in own.items()})
    described = [{"name": n, "cut": list(c) if c is not None else None, "shape": list(shape),
                  "dtype": str(np.asarray(d).dtype), "flat": [int(a), int(b)], "key": f"p{i}"}
                 for i, (n, c, shape, (a, b), d) in enumerate(pieces)]
    return Started(save_dir, step, stage, name, os.path.join(stage, name), arrays, described,
                   error)


def write_file(path: str, arrays: dict) -> tuple[dict | None, str | None]:
    """This rank's file of the save (no collective: a background thread may run it):
    (its digest, None) or (None, the error)."""
    try:
        raw = _npz_bytes(arrays)
        _write_atomic(path, raw)
        return {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}, None
    except OSError as e:
        return None, _oserror(e, path)


def publish(started: Started, comm, meta: dict | None, scalars: dict | None) -> str:
    """The save's last phase (collective, every rank's file written): every rank learns
    whether any failed; rank 0 writes the manifest and gives the stage its name, then
    ``latest``; a failure removes the stage and raises CheckpointError on every rank."""
    save_dir, step = started.save_dir, started.step
    folder = step_dir(save_dir, step)
    error = agree_failure(comm, started.error)
    if error is None:
        everyone = gather_json(comm, {"file": started.name, "digest": started.digest,
                                       "pieces": started.described})
        if comm.rank == 0:
            try:
                _write_manifest(started.stage, step, comm.size, everyone, meta, scalars)
                _publish(save_dir, started.stage, folder)
            except OSError as e:
                error = _oserror(e, folder)
        error = agree_failure(comm, error)      # complete on disk before anyone goes on
    if error is None:
        return folder
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(started.stage, ignore_errors=True)
    kept = _latest_name(save_dir)
    raise CheckpointError(f"saving checkpoint step {step} failed on {error}; "
                          + (f"the previous checkpoint ({kept}) is still 'latest'" if kept
                             else "no earlier checkpoint exists")
                          + " and nothing of the failed one is left")


def _publish(save_dir: str, stage: str, folder: str) -> None:
    """Rank 0: the complete ``partial.step_…`` takes its name (a rename), then ``latest``
    names it: a save cut off anywhere (node lost, SIGKILL) leaves no ``step_…`` half-written."""
    old = os.path.join(save_dir, f"{PARTIAL}replaced.{os.path.basename(folder)}")
    if os.path.isdir(folder):                    # the same step saved again: swap, then drop
        shutil.rmtree(old, ignore_errors=True)
        os.rename(folder, old)
    os.rename(stage, folder)
    _fsync_dir(save_dir)
    _write_atomic(os.path.join(save_dir, LATEST), os.path.basename(folder).encode())
    shutil.rmtree(old, ignore_errors=True)


def _write_manifest(folder, step, world, everyone, meta, scalars) -> None:
    """Rank 0: the manifest (every rank's file and pieces), written last into the folder."""
    files, tensors = {}, {}
    for entry in everyone:
        files[entry["file"]] = entry["digest"]
        for p in entry["pieces"]:
            t = tensors.setdefault(p["name"], {"shape": p["shape"], "dtype": p["dtype"],
                                               "pieces": []})
            t["pieces"].append({"file": entry["file"], "key": p["key"], "cut": p["cut"],
                                "flat": p["flat"]})
    manifest = {"format": FORMAT, "step": step, "world": world, "meta": meta or {},
                "scalars": scalars or {}, "files": files, "tensors": tensors}
    _write_atomic(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())


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
    if manifest.get("format") != FORMAT and isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath}: format {manifest.get('format')!r}, written by an "
                              f"older hpcdist; this one reads {FORMAT}")
    for key, kind in (("step", int), ("world", int), ("files", dict), ("tensors", dict)):
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
    reader = Reader(folder)
    reader.verify()
    return reader.manifest


def find_resume(save_dir: str) -> tuple[str | None, str]:
    """(folder to resume from or None, what was decided, in words).

    ``latest`` when its checkpoint verifies; else the newest ``step_*`` folder that does
    (said in the note); None only where ``save_dir`` holds no checkpoint at all. Raises
    CheckpointError where checkpoints exist and none verifies: never starts over silently.
    """
    folder, problems = newest_verified(save_dir)
    if folder is None and not problems:
        return None, f"no checkpoint in {save_dir}: starting at step 0"
    if folder is None:
        raise CheckpointError(f"--resume: no checkpoint in {save_dir} verifies: "
                              + "; ".join(problems) + ". Refusing to start over; remove the "
                              "folder or point --save-dir elsewhere to start a new run")
    if not problems:
        return folder, f"resuming from {folder} ('latest')"
    return folder, (f"resuming from {folder}, the newest checkpoint that verifies ("
                    + "; ".join(problems) + ")")


def prune(save_dir: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` complete checkpoints of ``save_dir`` (never the one
    ``latest`` names); the folders removed. Rank 0, after a save has completed."""
    latest_name = _latest_name(save_dir)
    complete = sorted(f for f in glob.glob(os.path.join(save_dir, "step_*"))
                      if os.path.isfile(os.path.join(f, MANIFEST)))
    removed = []
    for folder in complete[:max(0, len(complete) - keep)]:
        if os.path.basename(folder) != latest_name:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def newest_verified(save_dir: str) -> tuple[str | None, list]:
    """(the checkpoint to use, why each newer one was passed over): ``latest`` when it
    verifies, else the newest ``step_*`` folder that does; (None, []) where ``save_dir``
    holds no checkpoint, (None, problems) where none verifies."""
    steps = sorted(glob.glob(os.path.join(save_dir, "step_*")), reverse=True)
    name = _latest_name(save_dir)
    if name is None and not steps:
        return None, []
    problems = []
    if name is not None:
        folder = os.path.join(save_dir, name)
        try:
            verify(folder)
            return folder, []
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
        return folder, problems
    return None, problems


def _read_verified(folder: str, name: str, entry: dict) -> dict:
    """The arrays of one file of a checkpoint, after its size and SHA-256 match the manifest."""
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
            return {k: z[k] for k in z.files}
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


class Reader:
    """A verified checkpoint, read lazily: each file is checked (SHA-256) when first needed."""

    def __init__(self, folder: str):
        self.folder = folder
        self.manifest = read_manifest(folder)
        self.step, self.world = self.manifest["step"], self.manifest["world"]
        self.scalars = self.manifest.get("scalars", {})
        self.tensors = self.manifest["tensors"]
        self._files: dict = {}

    def _file(self, name: str) -> dict:
        if name not in self._files:
            entry = self.manifest["files"].get(name)
            if entry is None:
                raise CheckpointError(f"{os.path.join(self.folder, MANIFEST)} lists no {name}")
            self._files[name] = _read_verified(self.folder, name, entry)
        return self._files[name]

    def tensor(self, name: str) -> np.ndarray:
        """The logical tensor ``name`` (e.g. "param/wte.weight"), assembled from its pieces."""
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.folder}: no tensor {name!r} (this run's model or "
                                  "optimizer differs from the one that saved it)")
        pieces = [(p["cut"], tuple(p["flat"]), self._file(p["file"])[p["key"]])
                  for p in t["pieces"]]
        try:
            return reshard.assemble(tuple(t["shape"]), np.dtype(t["dtype"]), pieces)
        except ValueError as e:
            raise CheckpointError(f"{self.folder}: tensor {name!r}: {e}") from None

    def own(self, rank: int) -> dict:
        """Rank ``rank``'s own arrays (RNG state, residuals), as that rank wrote them."""
        arrays = self._file(f"rank_{rank:05d}.npz")
        return {k[len("own/"):]: v for k, v in arrays.items() if k.startswith("own/")}

    def verify(self) -> None:
        for name in self.manifest["files"]:
            self._file(name)
