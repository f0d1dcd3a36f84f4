"""The GPU stand-in's CuPy surface checked against the real CuPy (imported without a GPU).

``problems(tables)`` walks every entry of the GPU stand-in's tables (device_surface.MODULE,
NDARRAY, FLAGS, CUDA, CUPYX, RANDOM, NCCL) and returns what does not hold, first mismatch
first:

- the name exists in CuPy;
- it is the same kind (function, ufunc, class, dtype, constant, method, property);
- the parameters the GPU stand-in lets hpcdist pass bind to CuPy's signature: each listed
  positional parameter sits at the same place under the same name, each keyword is
  accepted, nothing CuPy requires is missing;
- typed entries (NCCL) have CuPy's C types, and ``get_unique_id`` returns what the table
  says (it runs without a GPU).

CuPy's Cython functions carry no ``inspect`` signature; their docstring's first line is the
signature (``_ndarray_base.get(self, stream=None, order='C', out=None, blocking=True)``).
"""
from __future__ import annotations

import inspect

import numpy as np

from hpcdist.device import standin as dd


def _resolve(root, dotted: str):
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def real_signature_text(obj) -> str | None:
    """CuPy's signature of ``obj`` as text ("(a, dtype=None)"), from inspect or the doc."""
    try:
        return str(inspect.signature(obj)).split(" -> ")[0]
    except (TypeError, ValueError):
        pass
    first = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    if not first or "(" not in first[0]:
        return None
    line = first[0]
    start, depth = line.index("("), 0
    for i in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            return line[start:i + 1].replace("\\*", "*")
    return None


def _plain(text: str) -> str:
    """Annotations dropped: "(shape: '_ShapeLike', dtype: X = <class 'float'>)" ->
    "(shape, dtype=...)"; "/" (positional-only marker) dropped."""
    out, depth, cur = [], 0, ""
    for ch in text.strip()[1:-1]:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    params = []
    for p in out:
        if p == "/":
            continue
        name = p.split("=")[0].split(":")[0].strip()
        params.append(f"{name.split()[-1] if not name.startswith('*') else name}"
                      + ("=None" if "=" in p else ""))
    return "(" + ", ".join(params) + ")"


def bind_problems(declared: str, real: str) -> list[str]:
    """Why a call that binds to ``declared`` might not bind to ``real`` (both as text)."""
    d, r = dd.signature(declared), dd.signature(_plain(real))
    dp, rp = list(d.parameters.values()), list(r.parameters.values())
    P = inspect.Parameter
    r_pos = [p for p in rp if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    r_names = {p.name: p for p in rp}
    r_var = {p.kind for p in rp}
    out = []
    for i, p in enumerate(q for q in dp if q.kind is P.POSITIONAL_OR_KEYWORD):
        if i >= len(r_pos):
            if P.VAR_POSITIONAL not in r_var:
                out.append(f"positional parameter {p.name!r} (#{i}) is not in CuPy's {real}")
        elif r_pos[i].name != p.name:
            out.append(f"positional parameter #{i} is {p.name!r} here, {r_pos[i].name!r} in "
                       f"CuPy's {real}")
    for p in dp:
        if p.kind is P.KEYWORD_ONLY or (p.kind is P.POSITIONAL_OR_KEYWORD and p.default
                                        is not P.empty):
            q = r_names.get(p.name)
            if (q is None or q.kind is P.POSITIONAL_ONLY) and P.VAR_KEYWORD not in r_var:
                out.append(f"keyword {p.name!r} is not accepted by CuPy's {real}")
        elif p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and p.kind not in r_var:
            out.append(f"{p} is not accepted by CuPy's {real}")
    d_names = {p.name for p in dp}
    for q in rp:
        if q.default is P.empty and q.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) \
                and q.name not in d_names and q.name != "self":
            out.append(f"CuPy's {real} requires {q.name!r}, which the GPU stand-in does not take")
    return out


def _kind_of(obj, owner_attr=None) -> str:
    import cupy
    if isinstance(obj, cupy.ufunc):
        return "ufunc"
    if isinstance(obj, type):
        return "class"
    if isinstance(obj, (int, float, str, bytes)):
        return "constant"
    if callable(obj):
        return "function"
    return "other"


def _member_kind(cls, name) -> str:
    """'method' or 'property' for an attribute found on a class."""
    for klass in cls.__mro__:
        if name in vars(klass):
            raw = vars(klass)[name]
            if isinstance(raw, property) or type(raw).__name__ in (
                    "getset_descriptor", "member_descriptor"):
                return "property"
            if callable(raw) or type(raw).__name__ in ("method_descriptor",
                                                       "cython_function_or_method"):
                return "method"
            return "other"
    return "missing"


def _check(where: str, real_obj, kind: str, text, owner=None, attr=None) -> list[str]:
    import cupy
    out = []
    if kind in ("method", "property"):
        got = _member_kind(owner, attr)
        if got == "missing":
            return [f"{where}: CuPy has no such attribute"]
        if got != kind:
            return [f"{where}: a {kind} in the GPU stand-in, a {got} in CuPy"]
    elif kind == "dtype":
        try:
            np.dtype(real_obj)
        except TypeError:
            return [f"{where}: not a dtype in CuPy ({real_obj!r})"]
        return []
    elif kind == "constant":
        return [] if not callable(real_obj) else [f"{where}: callable in CuPy, not a constant"]
    else:
        got = _kind_of(real_obj)
        if got != kind:
            return [f"{where}: a {kind} in the GPU stand-in, a {got} in CuPy"]
    if text is None:
        return out
    if kind == "ufunc":
        n = len(dd.signature(text).parameters)
        if real_obj.nin != n:
            out.append(f"{where}: {n} inputs in the GPU stand-in, {real_obj.nin} in CuPy")
        return out
    real = real_signature_text(real_obj if kind != "class" else real_obj)
    if real is None:
        return [f"{where}: CuPy's signature cannot be read (no inspect signature, no "
                "docstring signature)"]
    out += [f"{where}: {p}" for p in bind_problems(text, real)]
    declared_types = dd.typed_parameters(text)
    if declared_types:
        real_types = [t for t in dd.typed_parameters(real) if t[1] != "config"]
        if declared_types != real_types[:len(declared_types)]:
            out.append(f"{where}: typed {declared_types} in the GPU stand-in, {real_types} "
                       "in CuPy")
    return out


def roots(cublas: bool = False):
    import cupy
    import cupy.cuda.nccl
    import cupyx
    found = {}
    if cublas:                  # kernels/gemm.py's names: needs cuBLAS's wheel (libcublas)
        import types
        import importlib
        from hpcdist.device.kernels import gemm
        found["CUBLAS"] = ("", types.SimpleNamespace(**{
            k: importlib.import_module(v) for k, v in gemm._ROOTS.items()}))
    return found | {"MODULE": ("cupy", cupy), "NDARRAY": ("cupy.ndarray", cupy.ndarray),
            "CUDA": ("cupy.cuda", cupy.cuda), "CUPYX": ("cupyx", cupyx),
            "RANDOM": ("cupy.random", cupy.random), "NCCL": ("cupy.cuda.nccl", cupy.cuda.nccl)}


def _random_attr(root, dotted):
    """cupy.random's names, with its bit generators found where CuPy keeps them."""
    head = dotted.split(".")[0]
    if head == "XORWOW":
        from cupy.random import _bit_generator
        return _resolve(_bit_generator, dotted)
    return _resolve(root, dotted)


def problems(tables=None) -> list[str]:
    """Every entry of the GPU stand-in's surface that the real CuPy contradicts."""
    import cupy
    tables = tables or {name: getattr(dd, name) for name in
                        ("MODULE", "NDARRAY", "CUDA", "CUPYX", "RANDOM", "NCCL", "FLAGS")}
    out = []
    found = roots(cublas="CUBLAS" in tables)
    for table, entries in tables.items():
        if table == "FLAGS":
            from cupy._core import flags as cupy_flags
            have = set(dir(cupy_flags.Flags))
            out += [f"cupy.ndarray.flags.{f}: CuPy's flags have no {f!r} (they have "
                    f"{sorted(n for n in have if not n.startswith('_'))})"
                    for f in entries if f not in have]
            continue
        prefix, root = found[table]
        for name, (kind, text) in entries.items():
            where = f"{prefix}.{name}" if prefix else name
            owner, attr = None, None
            try:
                if kind in ("method", "property"):
                    if "." in name:
                        cls_name, attr = name.rsplit(".", 1)
                        owner = _random_attr(root, cls_name) if table == "RANDOM" else \
                            _resolve(root, cls_name)
                    else:
                        owner, attr = root, name
                    obj = getattr(owner, attr, None)
                else:
                    obj = _random_attr(root, name) if table == "RANDOM" else \
                        _resolve(root, name)
            except AttributeError:
                out.append(f"{where}: CuPy has no such name")
                continue
            out += _check(where, obj, kind, text, owner, attr)
            if table == "NCCL" and name == "get_unique_id":
                want = text.split("->")[1].strip()
                got = type(obj()).__name__
                if got != want:
                    out.append(f"{where}: returns {got} in CuPy, {want} in the GPU stand-in")
    del cupy
    return out
