"""Every console command README.md, jobs/README.md and docs/*.md show, run as typed
(shortened to a few steps where a full run would take minutes), in a fresh folder with the
venv active, and the sample outputs checked against what the program prints now.

Each command must have an entry in ``HOW``: the command as shown (its first words) -> a
shortened command to run here, or ``SKIP`` with the reason (a cluster, a GPU, a benchmark
that tests/test_bench_smoke.py runs small). A command added to the docs without an entry
fails the test, so nothing shown goes unchecked by accident.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "jobs" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
SKIP = "skip"
SHORT = "--steps 12 --log-every 6"

# command as shown (prefix, whitespace-normalised) -> (how to run it here | SKIP, reason)
HOW = {
    "make train": ("make -C {repo} train NP=4 ARGS='--steps 30 --log-every 10 --out-dir {tmp}/mt'",
                   "shortened: 30 steps on 4 ranks"),
    "make test ": (SKIP, "the whole suite: this test is part of it"),
    "make test-gpu": ("make -C {repo} test-gpu", "exits 0 saying no GPU is visible"),
    "make test-cupy": (SKIP, "CI runs it (.ci/run): it installs CuPy's, NCCL's, NVRTC's and "
                             "cuBLAS's wheels"),
    "python -m hpcdist.bench gpu --count": (SKIP, "tests/test_kernels.py counts a small GPT's "
                                                  "launches the same way"),
    "python -m hpcdist.bench kernels --device standin": (None, "as shown (the GPU stand-in: "
                                                               "seconds)"),
    "module load": (SKIP, "a cluster's environment modules"),
    "python3 -m venv .venv": (SKIP, "what make venv does (this test runs inside that venv)"),
    "pip install --no-binary=mpi4py": (SKIP, "builds mpi4py against a cluster's MPI"),
    "pip install -e '.[test]'": (SKIP, "what make venv does"),
    "nvidia-smi": (SKIP, "needs an NVIDIA driver"),
    "pip install -e '.[gpu-cuda12]'": (SKIP, "make test-cupy installs CuPy's wheel"),
    "python -c 'from mpi4py import MPI": (None, "as shown"),
    "sbatch": (SKIP, "tests/slurm submits every template to a local SLURM"),
    "export SLURM_CONF": (SKIP, "tests/slurm starts the local SLURM"),
    "mpirun -n 4 python -m hpcdist.train --trace runs/trace.json --comm-log":
        ("mpirun -n 4 python -m hpcdist.train --trace runs/trace.json --comm-log " + SHORT,
         "shortened"),
    "python -m hpcdist.bench plot runs/metrics.jsonl": (None, "as shown (a missing input "
                                                              "costs its plot only)"),
    ".venv/bin/mpiexec -n 4 .venv/bin/python -m hpcdist.train --help":
        ("{venv}/mpiexec -n 4 {venv}/python -m hpcdist.train --help", "the venv's path"),
    "mpirun -n 8 python -m hpcdist.train --task reverse": ("mpirun -n 8 python -m "
                                                           "hpcdist.train --task reverse "
                                                           + SHORT, "shortened"),
    "mpirun -n 4 python -m hpcdist.train --task text": (None, "+ " + SHORT),
    "mpirun -n 4 python -m hpcdist.train --config run.toml": (None, "+ " + SHORT),
    "NP=4 ARGS=\"--steps 200\" make train": ("make -C {repo} train NP=4 ARGS='--steps 12 "
                                             "--out-dir {tmp}/np4'", "shortened"),
    "mpirun -n 8 python -m hpcdist.train --tp 2 --pp 2": (None, "+ " + SHORT),
    "mpirun -n 8 python -m hpcdist.train --arch llama": (None, "+ " + SHORT),
    "mpirun -n 4 python -m hpcdist.train --arch llama": (None, "+ " + SHORT),
    "python -m hpcdist.train --arch llama": (None, "as shown"),
    "pip install -e '.[hf]'": (SKIP, "CI installs transformers and PyTorch (.ci/run); the "
                                     "transformers lines skip without them"),
    "mpirun -n 4 python -m hpcdist.train --cp": (None, "+ " + SHORT),
    "mpirun -n 4 python -m hpcdist.train --experts": (None, "+ " + SHORT),
    "mpirun -n 8 python -m hpcdist.train --experts": (None, "+ " + SHORT),
    "python -m hpcdist.bench moe": (SKIP, "a benchmark: tests/test_bench_smoke.py runs it "
                                          "small"),
    "python -m hpcdist.sample runs/ck --ids": (SKIP, "needs a checkpoint in runs/ck; "
                                               "tests/mpi/test_sample.py samples one"),
    "mpirun -n 8 python -m hpcdist.train --cp": (None, "+ " + SHORT),
    "mpirun -n 8 python -m hpcdist.train --zero": (None, "+ " + SHORT),
    "mpirun -n 8 python -m hpcdist.train --bucket-mb": (None, "+ " + SHORT),
    "make test-cluster": (SKIP, "needs root; part of make test"),
    "make test-faults": (SKIP, "part of make test"),
    "make venv-ompi": (SKIP, "part of make test (test-ulfm builds it)"),
    ".venv-ompi/bin/mpirun --with-ft ulfm": (SKIP, "tests/ulfm runs it with a rank killed"),
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 .venv-ompi/bin/mpirun":
        (SKIP, "tests/ulfm/test_recovery.py launches with exactly these settings (root, "
               "--oversubscribe on 2 cores) and a rank killed"),
    ".venv/bin/python -m hpcdist.bench recovery": (SKIP, "a benchmark (minutes) under Open "
                                                         "MPI; tests/ulfm covers its runs"),
    "python -m pytest -q tests/test_layers.py": (SKIP, "part of make test (unit)"),
    "python -m pytest -q tests/test_kernels_cpu.py": (SKIP, "part of make test (unit)"),
    "mpirun -n 8 python -m hpcdist.train --tp": (None, "+ " + SHORT),
    "mpirun -n 8 python -m hpcdist.train --pp 4": (None, "+ " + SHORT),
    "mpirun -n 4 python -m hpcdist.train --pp 2": (None, "+ " + SHORT),
    ".venv/bin/python -m hpcdist.bench": (SKIP, "a benchmark: tests/test_bench_smoke.py "
                                                "runs each small"),
    ".venv/bin/python -m hpcdist.bench zero --analytic": ("{venv}/python -m hpcdist.bench "
                                                         "zero --analytic 7e9 --world 8",
                                                         "instant: formulas only"),
    ".venv/bin/mpiexec -n 4 .venv/bin/python -m hpcdist.bench": (SKIP, "a benchmark: "
                                                                 "tests/test_bench_smoke.py"),
    "OMP_NUM_THREADS=1 .venv/bin/python -m hpcdist.bench": (SKIP, "a benchmark: "
                                                            "tests/test_bench_smoke.py"),
    "python -m hpcdist.bench schedule": (None, "as shown"),
    ".venv/bin/python -m hpcdist.bench autograd --shapes": (SKIP, "a benchmark (minutes): "
                                                           "tests/test_bench_smoke.py runs it "
                                                           "small"),
    ".venv/bin/python -m hpcdist.bench peers --train": (SKIP, "a benchmark (minutes) on 8 "
                                                        "ranks: tests/test_bench_smoke.py "
                                                        "runs peers small"),
    "python -m hpcdist.bench pipeline": (SKIP, "a benchmark: tests/test_bench_smoke.py"),
    "python -m hpcdist.bench plot runs/trace.json": (
        "mpirun -n 4 python -m hpcdist.train --pp 2 --trace runs/trace.json " + SHORT +
        " && {cmd}", "after a short --pp 2 run with --trace in the document's folder"),
    "mpirun -n 2 python -m hpcdist.train --steps 300 --save-dir runs/ck":
        ("mpirun -n 2 python -m hpcdist.train --steps 20 --save-dir runs/ck --save-every 10",
         "shortened"),
    "mpirun -n 8 python -m hpcdist.train --steps 600 --save-dir runs/ck --resume":
        ("mpirun -n 8 python -m hpcdist.train --steps 30 --save-dir runs/ck --resume --tp 2 "
         "--pp 2 --batch-size 8", "shortened"),
    "python -m hpcdist.train --steps 600 --save-dir runs/ck --resume":
        ("python -m hpcdist.train --steps 34 --save-dir runs/ck --resume --batch-size 128",
         "shortened"),
    "python -m hpcdist.checkpoint": (None, "as shown"),
    "python -c \"import transformers": (None, "as shown (skipped without transformers)"),
    "python -m hpcdist.plan": (None, "as shown"),
    "mpirun -n 4 python -m hpcdist.train --strategy diloco": (None, "+ " + SHORT),
    "python -m hpcdist.bench diloco": (SKIP, "a benchmark (~40 minutes for the table); "
                                            "tests/test_bench_smoke.py runs it small"),
    "python -m hpcdist.bench slowlinks": (SKIP, "as root, ~40 minutes on the cluster in a box; "
                                                "tests/cluster checks DiLoCo's and hybrid "
                                                "ZeRO's bytes on a shaped link, "
                                                "tests/test_bench_smoke.py its table"),
    "python -m hpcdist.run.compositions": (None, "as shown (prints the table of docs/compositions.md)"),
    "python -m hpcdist.data prepare": (None, "as shown"),
    "timeout -s TERM 60 mpirun -n 8 python -m hpcdist.train --task text":
        ("timeout --preserve-status -s TERM 30 mpirun -n 8 python -m hpcdist.train --task "
         "text --data runs/tok --block-size 64 --steps 100000 --save-dir runs/lm; test $? = 75",
         "stopped by SIGTERM sooner, then it must have exited 75"),
    "mpirun -n 4 python -m hpcdist.train --task text --data runs/tok":
        ("S=$(sed 's/step_0*//' runs/lm/latest); mpirun -n 4 python -m hpcdist.train --task "
         "text --data runs/tok --block-size 64 --steps $((S + 5)) --save-dir runs/lm --resume "
         "--batch-size 128", "five steps past the checkpoint"),
    "python -m hpcdist.sample": (None, "as shown"),
    "python -m hpcdist.checkpoint export runs/lm": (None, "as shown"),
    "python -c \"import transformers; print(transformers.pipeline": (None, "as shown"),
    "python -m hpcdist.data prepare corpus.txt --tokenizer hf/qwen2/tokenizer.json":
        ("python {repo}/tests/tiny_hf.py qwen2 hf/qwen2 corpus.txt && {cmd}",
         "as shown, after transformers saves a tiny random Qwen2 folder as hf/qwen2 (skipped "
         "without transformers)"),
    "mpirun -n 4 python -m hpcdist.train --init-from hf/qwen2":
        ("{cmd} --log-every 50", "as shown (skipped without transformers)"),
    "python -m hpcdist.sample runs/qwen": (None, "as shown (skipped without transformers)"),
    "python -m hpcdist.checkpoint export runs/qwen": (None, "as shown (skipped without "
                                                            "transformers)"),
    "python -m hpcdist.data prepare chats.jsonl --tokenizer hf/qwen2":
        ("python {repo}/tests/tiny_hf.py qwen2 hf/qwen2 corpus.txt && {cmd}",
         "as shown, after transformers saves a tiny random Qwen2 folder with a chat template "
         "as hf/qwen2 (skipped without transformers)"),
    "mpirun -n 4 python -m hpcdist.train --init-from hf/qwen2 --data runs/sft":
        ("{cmd} --log-every 30", "as shown (skipped without transformers)"),
    "mpirun -n 2 python -m hpcdist.evaluate runs/chat": (None, "as shown (skipped without "
                                                              "transformers)"),
    "python -m hpcdist.sample runs/chat": (None, "as shown (skipped without transformers)"),
    "python -m hpcdist.checkpoint export runs/chat": (None, "as shown (skipped without "
                                                            "transformers)"),
    "python -m hpcdist.checkpoint export runs/lora": (None, "as shown (skipped without "
                                                            "transformers)"),
    "python -m hpcdist.sample hf/qwen2 --adapter": (None, "as shown (skipped without "
                                                          "transformers)"),
}

_QA = [("where is the cat?", "the cat is on the mat."),
       ("where is the dog?", "the dog is by the river."),
       ("where is the bird?", "the bird is in the tree."),
       ("what is by the house?", "a dog and a cat.")]


def _chats(n: int, system: bool) -> str:
    import json
    return "".join(json.dumps({"messages": (
        [{"role": "system", "content": "answer in one line."}] if system and i % 3 == 0
        else []) + [{"role": "user", "content": _QA[i % 4][0]},
                    {"role": "assistant", "content": _QA[i % 4][1]}]}) + "\n"
        for i in range(n))


SETUP = {       # files a command reads, made in the fresh folder first
    "input.txt": "to be or not to be, that is the question. " * 400,
    "run.toml": "n_layer = 1\nn_embd = 32\nbatch_size = 16\n",
    "corpus.txt": "\n".join(f"the {w} of the {v} and a {w}" for w in ("cat", "dog", "bird")
                             for v in ("tree", "house", "river")) * 1500,
    "chats.jsonl": _chats(60, system=True),
    "val.jsonl": _chats(4, system=False),
}


def commands(path: Path):
    """(command, [sample output lines]) of every console block, continuation lines joined."""
    out, block, cmd, sample = [], False, None, []
    for line in path.read_text().splitlines():
        if line.startswith("```console"):
            block = True
            continue
        if block and line.startswith("```"):
            if cmd:
                out.append((cmd, sample))
            block, cmd, sample = False, None, []
            continue
        if not block:
            continue
        if line.startswith("$ "):
            if cmd:
                out.append((cmd, sample))
            cmd, sample = line[2:], []
        elif cmd is not None and cmd.rstrip().endswith("\\"):
            cmd = cmd.rstrip()[:-1] + " " + line.strip()
        elif cmd is not None:
            sample.append(line)
    return [(" ".join(strip_comment(c).split()), s) for c, s in out]


def strip_comment(cmd: str) -> str:
    """The command without its trailing '# ...' (outside quotes)."""
    quote = None
    for i, ch in enumerate(cmd):
        if ch in "'\"":
            quote = None if quote == ch else (quote or ch)
        elif ch == "#" and quote is None and (i == 0 or cmd[i - 1] == " "):
            return cmd[:i]
    return cmd


def how(cmd: str):
    best = max((k for k in HOW if (cmd + " ").startswith(k) or cmd.startswith(k.strip())),
               key=len, default=None)
    return best


def skeleton(line: str) -> str:
    """A line with its numbers, host names and times masked (what must not change is the rest)."""
    line = re.sub(r"\(\w[\w.-]*\)", "(HOST)", line)
    return " ".join(re.sub(r"[-+]?\d[\d,.]*(e[-+]?\d+)?", "N", line).split())


ALL = [(p.name, c, s) for p in DOCS for c, s in commands(p)]


def test_every_command_shown_has_a_way_to_run_here():
    missing = [c for _, c, _ in ALL if how(c) is None]
    assert not missing, f"commands in the docs without an entry in HOW: {missing}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A fresh folder with the venv first on PATH, as `. .venv/bin/activate` makes it."""
    tmp = tmp_path_factory.mktemp("docs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCDIST_", "PYTEST"))
           and k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                         "NUMBA_NUM_THREADS")}
    env.update(PATH=f"{VENV_BIN}:{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV_BIN.parent))
    return tmp, env


def run_doc(doc: str, tmp: Path, env: dict) -> list:
    """Run one document's commands in order in its own folder ``tmp`` (a document's commands
    may read what its earlier ones wrote); the failures."""
    for name, text in SETUP.items():
        (tmp / name).write_text(text)
    failures = []
    for _, cmd, sample in [x for x in ALL if x[0] == doc]:
        key = how(cmd)
        run, why = HOW[key]
        if run == SKIP:
            continue
        if ("transformers" in cmd or "transformers" in why) and not HAVE_TRANSFORMERS:
            continue
        line = cmd if run is None else run
        if run is None and why.startswith("+ "):
            line = f"{cmd} {why[2:]}"
        line = line.format(repo=REPO, tmp=tmp, venv=VENV_BIN, cmd=cmd)
        r = subprocess.run(line, shell=True, cwd=tmp, env=env, capture_output=True, text=True,
                           timeout=600, executable="/bin/bash")
        if r.returncode != 0:
            failures.append(f"{doc}: `{cmd}` (ran `{line}`) exited {r.returncode}:\n"
                            f"{(r.stdout + r.stderr)[-1500:]}")
            continue
        printed = {skeleton(x) for x in r.stdout.splitlines()}
        for want in sample:
            if want.strip() in ("", "...") or want.lstrip().startswith("#"):
                continue
            if want.startswith(".venv/bin/"):               # make echoes its command
                if not any(skeleton(x).startswith(skeleton(want)) for x in
                           r.stdout.splitlines()):
                    failures.append(f"{doc}: `{cmd}` did not print `{want}`")
                continue
            if skeleton(want) not in printed:
                failures.append(f"{doc}: `{cmd}` printed no line like `{want}`; it printed:\n"
                                + r.stdout[-1500:])
    return failures


HAVE_TRANSFORMERS = subprocess.run([sys.executable, "-c", "import transformers"],
                                   capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("doc", list(dict.fromkeys(doc for doc, _, _ in ALL)))
def test_the_commands_run_as_typed_and_print_what_the_docs_show(folder, doc):
    """Each document in a fresh folder of its own, its commands in order; one test per
    document, so that pytest-xdist spreads them over its workers (make test-unit's two
    processes: many of the commands are one process, and the two cores share them)."""
    tmp, env = folder
    if shutil.which("mpirun", path=env["PATH"]) is None:
        pytest.skip("no mpirun in the venv or on PATH")
    own = tmp / doc.replace(".md", "")
    own.mkdir()
    failures = run_doc(doc, own, env)
    assert not failures, "\n\n".join(failures)
