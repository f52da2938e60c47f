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
