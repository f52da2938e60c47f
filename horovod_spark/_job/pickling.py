"""Pickling the training function, and naming what cannot be pickled.

The *payload* is the cloudpickle of (fn, args, kwargs).  When cloudpickle
refuses it, the driver searches what the function *captures* (closure
variables, referenced globals, defaults, the object of a bound method, the
parts of a partial) and, inside those, list items, dict values and object
attributes, a few levels deep, and names the innermost part that cannot be
pickled, e.g. `train (closure variable 'lock')`, so the fix is obvious.

cloudpickle (3.1) blanks the file name of functions it pickles by value, so a
rank's traceback says `File "<dynamic-code>"`; `restore_frames` puts the file
name and source line back on the driver, from the functions the job carried.
"""
from __future__ import annotations

import functools
import linecache
import re
from typing import Mapping, Optional, Sequence

__all__ = ["pickle_job", "find_unpicklable", "code_files", "restore_frames"]


def _captured(fn):
    """(label, object) for what a function carries into a pickle."""
    if isinstance(fn, functools.partial):
        yield f"{_name(fn)}.func", fn.func
        yield from ((f"argument {i} of the partial", a) for i, a in enumerate(fn.args))
        yield from ((f"keyword {k!r} of the partial", v) for k, v in fn.keywords.items())
        return
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        yield "the object of the bound method", fn.__self__
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        yield from ((f"attribute {k!r}", v) for k, v in getattr(fn, "__dict__", {}).items())
        return
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield f"closure variable {name!r}", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for name in sorted(_global_names(code)):
        if name in fn.__globals__:
            yield f"global {name!r}", fn.__globals__[name]
    yield from ((f"default of argument {i}", d) for i, d in enumerate(fn.__defaults__ or ()))
    yield from ((f"default of {k!r}", d) for k, d in (fn.__kwdefaults__ or {}).items())


def _global_names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _global_names(const)
    return names


def _children(obj):
    if callable(obj) and (hasattr(obj, "__code__") or isinstance(obj, functools.partial)):
        yield from ((f" ({label})", sub) for label, sub in _captured(obj))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from ((f"[{i}]", sub) for i, sub in enumerate(obj))
    elif isinstance(obj, dict):
        yield from ((f"[{k!r}]", sub) for k, sub in obj.items())
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from ((f".{k}", sub) for k, sub in vars(obj).items())


def find_unpicklable(obj, label: str, depth: int = 0):
    """(path, object, error) of the innermost part of `obj` cloudpickle refuses, or None."""
    import cloudpickle

    try:
        cloudpickle.dumps(obj)
        return None
    except Exception as exc:
        error = exc
    if depth < 4:
        for sub_label, sub in _children(obj):
            found = find_unpicklable(sub, label + sub_label, depth + 1)
            if found is not None:
                return found
    return label, obj, error


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def pickle_job(fn, args: Sequence = (), kwargs: Optional[Mapping] = None) -> bytes:
    """cloudpickle of (fn, args, kwargs).

    Raises:
        TypeError: naming the captured object that cannot be pickled.
    """
    import cloudpickle

    if not callable(fn):
        raise TypeError(f"the training function must be callable, got {type(fn).__name__}")
    args, kwargs = tuple(args), dict(kwargs or {})
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        parts = [(_name(fn), fn)] + [(f"argument {i}", a) for i, a in enumerate(args)] + \
                [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        for label, part in parts:
            found = find_unpicklable(part, label)
            if found is not None:
                path, culprit, error = found
                raise TypeError(
                    f"cannot send {_name(fn)} to the ranks: {path} is a "
                    f"{type(culprit).__module__}.{type(culprit).__qualname__}, which cannot be "
                    f"pickled ({type(error).__name__}: {error}); create it inside the function, "
                    f"or pass what it is made from as an argument") from exc
        raise TypeError(f"cannot pickle {_name(fn)} and its arguments: "
                        f"{type(exc).__name__}: {exc}") from exc



_DYNAMIC_FRAME = re.compile(r'^(\s*)File "<dynamic-code>", line (\d+), in (\S+)$')


def code_files(fn, depth: int = 0) -> dict:
    """name -> source file of the functions `fn` carries, found without pickling."""
    out: dict = {}
    if depth > 3:
        return out
    for label, obj in [("", fn)] + list(_captured(fn)):
        code = getattr(getattr(obj, "__func__", obj), "__code__", None)
        if code is None:
            continue
        stack = [code]
        while stack:
            c = stack.pop()
            out.setdefault(c.co_name, c.co_filename)
            stack.extend(k for k in c.co_consts if hasattr(k, "co_name"))
        if obj is not fn and callable(obj):
            for name, path in code_files(obj, depth + 1).items():
                out.setdefault(name, path)
    return out


def restore_frames(traceback_text: str, files: Mapping[str, str]) -> str:
    """Put file names and source lines back into frames cloudpickle left as <dynamic-code>."""
    lines, out = traceback_text.splitlines(), []
    for i, line in enumerate(lines):
        m = _DYNAMIC_FRAME.match(line)
        path = files.get(m.group(3)) if m else None
        if not path or path.startswith("<"):
            out.append(line)
            continue
        indent, lineno = m.group(1), int(m.group(2))
        out.append(f'{indent}File "{path}", line {lineno}, in {m.group(3)}')
        source = linecache.getline(path, lineno).strip()
        following = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if source and following != source:
            out.append(f"{indent}  {source}")
    return "\n".join(out) + ("\n" if traceback_text.endswith("\n") else "")
