"""Code-shape rules that hold on main, checked statically (ast) so they cannot drift back
unnoticed (issues 21 and 35): files of at most 500 lines, functions of at most 80 (60 in
decode/ and models/), no import cycle, one step-cost table, no module clones, cache fields
written only by caches, no capability of a model discovered with getattr/hasattr."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_mtp"
MAX_FUNCTION_LINES = 80
CORE_FUNCTION_LINES = 60  # decode/ and models/: the engine's core reads a screen at a time
CORE = ("decode", "models")
MAX_FILE_LINES = 500


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
    limit = CORE_FUNCTION_LINES if _subpackage(path) in CORE else MAX_FUNCTION_LINES
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
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


def _modules(*subpackages):
    for path in sorted(PACKAGE.rglob("*.py")):
        if not subpackages or _subpackage(path) in subpackages:
            yield path, ast.parse(path.read_text())


def _where(path, node) -> str:
    return f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}"


def test_one_step_cost_table():
    """What a step costs is one table (decode/costs.py), timed once by the driver: every
    reader (K policy, draft-source chooser, vocabulary tuner) asks it."""
    tables = [_where(path, node) for path, tree in _modules() for node in ast.walk(tree)
              if isinstance(node, ast.ClassDef) and node.name.endswith("Costs")]
    assert tables == [t for t in tables if t.startswith("decode/costs.py:")] and tables, tables


def test_no_module_clones():
    """Families override mlx-lm pieces by subclassing or composition: a module copied into a
    namespace to swap one name hides which code runs."""
    found = [_where(path, node) for path, tree in _modules("models") for node in ast.walk(tree)
             if isinstance(node, ast.Name) and node.id == "SimpleNamespace"]
    assert not found, f"module or self stand-ins (SimpleNamespace) in models/: {found}"


def _names_a_cache(node) -> bool:
    base = node.value
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    return "cache" in name.lower() or name == "c"


def test_cache_fields_written_only_by_caches():
    """Outside models/cache/ a cache is used through its methods: no field assigned, no
    private field read, no attribute attached to it."""
    found = []
    for path, tree in _modules():
        if path.relative_to(PACKAGE).parts[:2] == ("models", "cache"):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _names_a_cache(node)):
                continue
            if isinstance(node.ctx, ast.Store) or node.attr.startswith("_"):
                found.append(f"{_where(path, node)} .{node.attr}")
    assert not found, f"cache fields touched outside the cache package: {found}"


def test_layers_do_not_ask_a_cache_its_class():
    """Every cache kind answers for its own mask and state: layers never branch on its class."""
    found = []
    for path, tree in _modules("models"):
        if path.relative_to(PACKAGE).parts[:2] == ("models", "cache"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "isinstance" and len(node.args) == 2
                    and "Cache" in ast.unparse(node.args[1])):
                found.append(_where(path, node))
    assert not found, f"isinstance on cache classes in layers: {found}"


def _is_model(node) -> bool:
    text = ast.unparse(node)
    return text == "model" or text.endswith((".model", ".text"))


def test_model_capabilities_are_declared_not_discovered():
    """The engine asks a model only what models/interface.py declares: no getattr/hasattr on
    a model in decode/ or server/, and no attribute attached to one from outside models/."""
    found = []
    for path, tree in _modules("decode", "server", "bench", "convert", "tools", "options",
                               "generate"):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and _is_model(node.args[0])):
                found.append(f"{_where(path, node)} {node.func.id}")
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and _is_model(node.value)):
                found.append(f"{_where(path, node)} sets .{node.attr}")
    assert not found, f"undeclared model capabilities: {found}"
