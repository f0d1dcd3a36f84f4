"""Helpers shared by the benchmarks: launching under mpiexec, tables, result files."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def mpiexec() -> str:
    """The venv's mpiexec (MPICH wheel) when there is one, else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else "mpiexec"


def run_ranks(n: int, args: list, timeout: float = 1800) -> list:
    """Run ``python -m hpcdist.bench ARGS`` on n ranks; return rank 0's JSON result lines."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run([mpiexec(), "-n", str(n), sys.executable, "-m", "hpcdist.bench", *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"benchmark on {n} ranks failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines()
            if line.startswith("RESULT ")]


def relaunch(name: str, ranks: int, argv) -> list:
    """Run benchmark ``name``'s worker on ``ranks`` ranks with the same options."""
    rest = [a for a in (argv or []) if a != "--worker"]
    return run_ranks(ranks, [name, "--worker", *rest])


def emit(record: dict) -> None:
    """A worker's result line, read back by ``run_ranks``."""
    print("RESULT " + json.dumps(record), flush=True)


def table(rows: list, columns: list) -> str:
    """A fixed-width text table: columns are (header, key, format)."""
    head = " ".join(f"{h:>{max(len(h), 10)}s}" for h, _, _ in columns)
    lines = [head]
    for r in rows:
        cells = []
        for h, k, fmt in columns:
            v = r.get(k)
            cells.append(f"{(format(v, fmt) if v is not None else '-'):>{max(len(h), 10)}s}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def write_json(path: str, payload) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or a clear exit without it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
