"""Dependencies point down only: horovod_spark -> collectives -> native."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FRAMEWORKS = {"torch", "tensorflow", "keras", "cupy", "mpi4py", "pyspark"}


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], node, path
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node, path


def _top_level(path):
    """Imports at module level (not inside functions): these must not pull in frameworks."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def test_collectives_never_imports_horovod_spark_or_pyspark():
    bad = [f"{p.relative_to(ROOT)}:{n.lineno} imports {m}"
           for p in (ROOT / "collectives").rglob("*.py")
           for m, n, _ in _imports(p) if m in ("horovod_spark", "pyspark")]
    assert not bad, bad


def test_collectives_imports_frameworks_lazily():
    bad = [f"{p.relative_to(ROOT)} imports {m} at module level"
           for p in (ROOT / "collectives").rglob("*.py")
           for m in _top_level(p) if m in FRAMEWORKS]
    assert not bad, bad


def test_import_collectives_pulls_in_no_framework():
    import subprocess, sys
    code = ("import sys, collectives; bad = [m for m in %r if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)" % sorted(FRAMEWORKS))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_native_sources_never_read_the_environment_print_or_exit():
    import re
    pat = re.compile(r"(?<![\w:.])(getenv|printf|puts|exit|abort)\s*\(|std::(cout|cerr)")
    bad = [f"{p.relative_to(ROOT)}:{i + 1}: {line.strip()}"
           for p in sorted((ROOT / "native").rglob("*")) if p.suffix in (".cc", ".cpp", ".h", ".hpp")
           for i, line in enumerate(p.read_text().splitlines())
           if pat.search(line.split("//")[0])]
    assert not bad, bad


# -- privacy and cycles ------------------------------------------------------
# An import names a dotted path: `import a.b.c` names a.b.c; `from a.b import c, d`
# names a.b.c and a.b.d (relative forms resolved against the importing module),
# whether c is a module or a name defined in a.b; `m._x`, where an import bound m
# to one of our modules a.b.m, names a.b.m._x.  Function-level imports count;
# imports under `if TYPE_CHECKING:` do too (there are none).
#
# Private: a component of the path that starts with one underscore (not a
# dunder) belongs to its *owner*: the package it sits in (for `a.b._c`, a.b;
# for a name `_x` of module a.b.m, the package a.b).  A module may import a
# private path only from inside every owner along it: collectives.fusion.lane may
# import collectives._native, horovod_spark.tensorflow._lane_op may not.
#
# Cycles: a module imports the module its path names (a.b.c when that is a
# module, else a.b), not the packages above it that Python also runs; a cycle is
# a cycle of that graph among the modules of collectives and horovod_spark.

OURS = ("collectives", "horovod_spark")

# What the job machinery and the estimator still import across the rule, each with
# why it is here; its owner (issue 19, item 1) empties it.  Entries are
# "importer -> imported path".
PRIVATE_ALLOWED: dict = {}


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(dotted):
    return (ROOT.joinpath(*dotted.split(".")) / "__init__.py").is_file()


def _is_module(dotted):
    base = ROOT.joinpath(*dotted.split("."))
    return _is_package(dotted) or base.with_suffix(".py").is_file() or \
        any(base.parent.glob(base.name + ".*.so"))


def _named_paths(path):
    """(dotted path named, line) for every import in the file, relative ones resolved,
    and for every attribute read off a name an import bound to one of our modules
    (`driver._attempt` after `from horovod_spark._job import driver`)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    bound[a.asname] = a.name
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                dotted = f"{base}.{a.name}" if a.name != "*" else base
                if a.name != "*" and _is_module(dotted):
                    bound[a.asname or a.name] = dotted
                yield dotted, node.lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in bound and node.attr.startswith("_") and \
                not node.attr.startswith("__"):
            yield f"{bound[node.value.id]}.{node.attr}", node.lineno


def _owners(dotted):
    """The owner of every private component of `dotted` (see above)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if i and part.startswith("_") and not part.startswith("__"):
            above = ".".join(parts[:i])
            yield above if _is_package(above) else ".".join(parts[:i - 1])


def _our_files():
    return [p for top in OURS for p in sorted((ROOT / top).rglob("*.py"))]


def test_no_module_imports_another_packages_private_module_or_name():
    bad = []
    for path in _our_files():
        me = _module_name(path)
        mine = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for dotted, line in _named_paths(path):
            if dotted.split(".")[0] not in OURS:
                continue
            for owner in _owners(dotted):
                if not (mine == owner or mine.startswith(owner + ".")):
                    key = f"{me} -> {dotted}"
                    if key not in PRIVATE_ALLOWED:
                        bad.append(f"{path.relative_to(ROOT)}:{line}: {key} (private to {owner})")
    assert not bad, "\n".join(bad)


def test_the_allow_list_names_only_imports_that_still_exist():
    found = set()
    for path in _our_files():
        found.update(f"{_module_name(path)} -> {d}" for d, _ in _named_paths(path))
    assert not set(PRIVATE_ALLOWED) - found, sorted(set(PRIVATE_ALLOWED) - found)


def _graph():
    graph = {}
    for path in _our_files():
        targets = set()
        for dotted, _ in _named_paths(path):
            if dotted.split(".")[0] not in OURS:
                continue
            while dotted and not _is_module(dotted):
                dotted = dotted.rpartition(".")[0]
            if dotted:
                targets.add(dotted)
        me = _module_name(path)
        targets.discard(me)
        graph[me] = targets
    return graph


def _cycles(graph):
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_the_packages_modules():
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_horovod_core_imports_no_framework_and_no_adapter():
    """horovod_spark/common is what the torch, TensorFlow and Keras adapters share: it
    imports none of them, and no framework at module level."""
    adapters = {"torch", "tensorflow", "keras"}
    bad = []
    for p in (ROOT / "horovod_spark" / "common").rglob("*.py"):
        bad += [f"{p.relative_to(ROOT)} imports {m} at module level"
                for m in _top_level(p) if m in FRAMEWORKS]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and \
                    (node.module or "").split(".")[0] in adapters:
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno} imports the adapter {node.module}")
    assert not bad, bad


def test_the_adapters_the_core_and_the_rank_progress_never_reach_into_the_job_machinery():
    """horovod_spark/_job is the driver's and the task's; what runs in a rank's training
    code (the torch, TensorFlow, Keras and JAX adapters, the Horovod core in common/,
    progress/) reads its switches from horovod_spark/settings.py, never from _job."""
    bad = []
    for sub in ("torch", "tensorflow", "keras", "jax", "common", "progress"):
        for p in (ROOT / "horovod_spark" / sub).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ImportFrom) and "_job" in (node.module or "").split("."):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {node.module}")
                if isinstance(node, ast.Import) and any("._job" in a.name for a in node.names):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno} imports _job")
    assert not bad, bad


def test_the_job_machinery_is_reached_through_its_face_only():
    """Outside horovod_spark/_job, package code imports the job machinery from
    horovod_spark._job (its __init__, the face), never one of its modules."""
    bad = []
    for p in (ROOT / "horovod_spark").rglob("*.py"):
        if "_job" in p.relative_to(ROOT / "horovod_spark").parts[:1]:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = (node.module or "").split(".")
                if "_job" in parts and parts.index("_job") < len(parts) - 1:
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                bad += [f"{p.relative_to(ROOT)}:{node.lineno} imports {a.name}"
                        for a in node.names if "._job." in a.name]
    assert not bad, bad


def test_the_job_face_names_what_its_modules_define():
    import horovod_spark._job as job

    for name in job.__all__:
        value = getattr(job, name)
        where = getattr(value, "__module__", None) or value.__name__
        assert where.startswith("horovod_spark._job."), (name, where)
