"""Code-shape targets of issue 21 that hold on main: checked statically (ast), so they cannot
drift back unnoticed. Every file of the package has at most 600 lines and no function over 80,
but the few listed as still being reworked."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_mtp"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600


def _subpackage(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else rel[0][:-3]


def _imported_subpackages(path: Path) -> set:
    """Subpackages of mlx_mtp that ``path`` imports, at module level or inside functions."""
    own = path.relative_to(PACKAGE).parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(own[:len(own) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
                names = [parts] if parts else [[a.name] for a in node.names]
            elif node.module and node.module.startswith("mlx_mtp."):
                names = [node.module.split(".")[1:]]
            else:
                continue
            found.update(p[0] for p in names if p)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("mlx_mtp."))
    return found


def _graph() -> dict:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        src = _subpackage(path)
        graph.setdefault(src, set()).update(_imported_subpackages(path) - {src})
    return graph


def test_convert_and_train_do_not_import_each_other_both_ways():
    graph = _graph()
    assert not ("train" in graph.get("convert", set()) and "convert" in graph.get("train", set())), (
        "convert <-> train import cycle: move what both need below them (e.g. mlx_mtp/text_corpus.py)")


def _shape_faults(path: Path) -> list:
    """Where ``path`` is over the file or function limit."""
    lines = path.read_text().splitlines()
    name = path.relative_to(PACKAGE).as_posix()
    faults = [f"{name}: {len(lines)} lines"] if len(lines) > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                faults.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return faults


def test_files_and_functions_fit_a_screen():
    faults = [f for path in sorted(PACKAGE.rglob("*.py")) for f in _shape_faults(path)]
    assert not faults, "split these into named pieces: " + "; ".join(faults)


def test_no_two_subpackages_import_each_other():
    graph = _graph()
    cycles = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, set()))
    assert not cycles, f"import cycles between subpackages: {cycles}"


def test_benchmarks_import_mlx_mtp_before_mlx():
    """A script that imports MLX first runs on the wheel's reference BLAS (``platform/blas.py``:
    the OpenBLAS shim must load before MLX), and times something slower than a user gets."""
    late = []
    for path in sorted((PACKAGE.parent / "benchmarks").glob("*.py")):
        first = {}
        for node in ast.parse(path.read_text()).body:  # module level, in order
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for root in (name.split(".")[0] for name in names):
                if root in ("mlx", "mlx_lm"):
                    first.setdefault("mlx", node.lineno)
                elif root in ("mlx_mtp", "families_oracle"):  # the latter imports mlx_mtp first
                    first.setdefault("mlx_mtp", node.lineno)
        if "mlx" in first and first["mlx"] < first.get("mlx_mtp", 1 << 30):
            late.append(path.name)
    assert not late, f"import mlx_mtp before MLX (or mlx_lm) in: {late}"
