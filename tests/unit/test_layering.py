"""The layering the code promises, checked on the code itself.

- app/ is the domain core: it imports neither deployments/ nor rollout/ nor Ray, not even
  lazily inside a function (checked on the source), and importing all of it loads no Ray
  (checked in a fresh interpreter, so a transitive import counts too).
- The pure modules (manifest, generations, contracts, plan, state, machine, analysis, the
  cache, the load's control) load no Ray, no torch and no database driver when imported on
  their own, in a fresh interpreter.
- The ingress core (app/ingress) imports no HTTP framework either: the router's Serve shell
  turns Starlette requests into the core's arguments and its answers into responses.
- rollout/cli (the command line) is the top: nothing else of the product imports it.
  rollout/local (the one-machine harness) is for the demo, the tests and the benchmarks:
  nothing else of the product imports it, and it does not import the CLI.
- No import cycle among the modules of app/, deployments/ and rollout/, lazy imports included.
- The contracts (app/contracts/, one module per boundary) import nothing of app/ but each other
  and app.errors: the model families, the loader and the rest depend on them, never the
  reverse (the default families are contract vocabulary, re-exported by app.model_family).
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "app"
CORE_MUST_NOT_IMPORT = ("ray", "deployments", "rollout")
PURE_MODULES = (
    "app.manifest",
    "app.generations",
    "app.contracts",
    # Each boundary's contracts on their own: a process that needs one pays for no other's.
    "app.contracts.vocabulary",
    "app.contracts.targets",
    "app.contracts.replica_config",
    "app.contracts.router_config",
    "app.contracts.app_args",
    "app.contracts.reports",
    "app.contracts.wire",
    "app.contracts.views",
    "app.safe_text",
    "app.divergence",
    # The ingress core: the router's decisions, without Ray, Starlette or torch.
    "app.ingress",
    "app.ingress.routing",
    "app.ingress.standby",
    "app.ingress.shadow",
    "app.ingress.coalescing",
    "app.ingress.answers",
    "app.ingress.instruments",
    "app.ingress.probes",
    "app.ingress.standby_gate",
    "app.ingress.core",
    "app.ingress.oip",
    "app.ingress.oip_endpoint",
    # A family's declaration and request schema: the router holds them.
    "app.model_family",
    # What a family's answers are for: the router reads its task's route and comparison.
    "app.tasks",
    "app.tasks.base",
    "app.tasks.rank",
    "app.tasks.classify",
    "app.tasks.score",
    "app.tasks.embed",
    "app.preprocessing",
    # What reads manifests only (rollout verify, registry register) must not pay for torch:
    # the compatibility check, the verified cache, the load's control (the cache paces and
    # counts with it) and the loading package itself (its modules are imported one by one).
    "app.compatibility",
    "app.cache",
    "app.safe_files",
    "app.loading",
    "app.loading.control",
    "app.models.ranker_mlp",
    "app.models.ranker_mlp.features",
    "app.models.two_tower",
    "app.models.two_tower.features",
    "rollout.plan",
    "rollout.state",
    "rollout.persisted",
    "rollout.machine",
    "rollout.judging",
    "rollout.analysis",
    "rollout.sequential",
    "rollout.evidence",
    "rollout.custom_judge",
    "rollout.estimate",
    "rollout.start_estimate",
    "rollout.step_progress",
    "rollout.shadow_judge",
    "rollout.serve_config",
)
PURE_MUST_NOT_LOAD = ("ray", "torch", "psycopg", "psycopg_pool", "sqlite3", "_sqlite3")


def imported_roots(source: str) -> set[str]:
    """Top-level package names a module's source imports, at any depth of the code."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def loaded_after_import(*modules: str) -> list[str]:
    """Top-level packages in sys.modules after importing ``modules`` in a fresh interpreter."""
    code = (
        "import importlib, json, sys\n"
        "for name in sys.argv[1:]: importlib.import_module(name)\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def core_modules() -> list[str]:
    names = []
    for path in sorted(CORE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_scan_sees_imports_at_any_depth() -> None:
    source = "import os\n\ndef f():\n    from ray import serve\n    import rollout.machine\n"
    assert imported_roots(source) == {"os", "ray", "rollout"}


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_source_imports_no_outer_layer_or_ray(path: Path) -> None:
    bad = imported_roots(path.read_text()) & set(CORE_MUST_NOT_IMPORT)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: app/ is the core"


def test_importing_the_whole_core_loads_no_ray() -> None:
    loaded = set(loaded_after_import(*core_modules()))
    assert not loaded & set(CORE_MUST_NOT_IMPORT), sorted(loaded & set(CORE_MUST_NOT_IMPORT))


@functools.cache
def loaded_by_every_pure_module() -> frozenset[str]:
    """What importing all of PURE_MODULES loads, in one fresh interpreter: the union of what
    each loads on its own (an import loads the same modules whatever was imported before;
    nothing here decides what to import by what is loaded). One interpreter for 40-odd
    modules, instead of one each (about half a second apiece)."""
    return frozenset(loaded_after_import(*PURE_MODULES))


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_loads_no_ray_torch_or_database(module: str) -> None:
    if not loaded_by_every_pure_module() & set(PURE_MUST_NOT_LOAD):
        return  # none of them loads any: nor does this one
    # One of them does: this module's own interpreter says whether it is this one.
    bad = set(loaded_after_import(module)) & set(PURE_MUST_NOT_LOAD)
    assert not bad, f"importing {module} loads {sorted(bad)}"


INGRESS = CORE / "ingress"
INGRESS_MUST_NOT_IMPORT = ("ray", "starlette", "fastapi", "torch", "psycopg", "sqlite3")
INGRESS_MUST_NOT_LOAD = (*PURE_MUST_NOT_LOAD, "starlette", "fastapi")


@pytest.mark.parametrize(
    "path", sorted(INGRESS.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_ingress_source_imports_no_ray_http_framework_torch_or_database(path: Path) -> None:
    bad = imported_roots(path.read_text()) & set(INGRESS_MUST_NOT_IMPORT)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: app/ingress is Ray-free"


def test_importing_the_ingress_core_loads_no_ray_http_framework_torch_or_database() -> None:
    modules = [m for m in core_modules() if m.startswith("app.ingress")]
    assert "app.ingress.core" in modules, modules
    bad = set(loaded_after_import(*modules)) & set(INGRESS_MUST_NOT_LOAD)
    assert not bad, f"importing app.ingress loads {sorted(bad)}"


CONTRACTS = CORE / "contracts"
CONTRACTS_MAY_IMPORT = ("app.contracts", "app.errors")


def imported_module_names(source: str) -> set[str]:
    """Absolute module names a module's source imports, at any depth of the code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    "path", sorted(CONTRACTS.glob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_contracts_import_no_other_part_of_the_core(path: Path) -> None:
    inside = {m for m in imported_module_names(path.read_text()) if m.split(".")[0] == "app"}
    bad = {m for m in inside if not m.startswith(CONTRACTS_MAY_IMPORT)}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: app/ depends on the contracts"


def test_importing_the_contracts_loads_no_model_family() -> None:
    code = (
        "import sys, app.contracts\n"
        "print(sorted(n for n in sys.modules if n.startswith('app.') and "
        "not n.startswith(('app.contracts', 'app.errors'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------------------- the test tiers
# tests/unit is the tier that runs without Ray: its modules import no Ray and no Serve shell
# (deployments/), not even inside a test, and importing all of them loads no Ray. The shells
# driven in process live in tests/inprocess; tests/conftest.py, loaded by every tier, loads
# no torch (a run of the pure tiers should not pay for it before the first test).
UNIT_TESTS = ROOT / "tests" / "unit"
UNIT_MUST_NOT_IMPORT = ("ray", "deployments")


def unit_test_files() -> list[Path]:
    """Every module of the tier, in its subpackages too (they mirror the code's packages)."""
    return sorted(UNIT_TESTS.rglob("*.py"))


def unit_test_modules() -> list[str]:
    names = []
    for path in unit_test_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("path", unit_test_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_unit_test_source_imports_no_ray_or_serve_shell(path: Path) -> None:
    bad = imported_roots(path.read_text()) & set(UNIT_MUST_NOT_IMPORT)
    assert not bad, (
        f"{path.relative_to(ROOT)} imports {sorted(bad)}: tests/unit runs without Ray "
        "(in-process tests of the Serve shells go to tests/inprocess)"
    )


def test_importing_every_unit_test_module_loads_no_ray() -> None:
    modules = unit_test_modules()
    assert len(modules) > 40, modules  # the walk found the tier
    loaded = set(loaded_after_import(*modules))
    assert "ray" not in loaded, "a tests/unit module loads Ray when imported"


def test_the_shared_conftest_loads_no_torch_and_no_ray() -> None:
    bad = set(loaded_after_import("tests.conftest")) & {"torch", "ray"}
    assert not bad, f"tests/conftest.py loads {sorted(bad)}"


# ------------------------------------------------------------------------- the binary's start
# Scripts, CI gates and shells call `rollout` often: a command that reads the registry or
# talks to the controller starts without torch, Ray, the object-store clients (aiohttp,
# fsspec), numpy or rich; each is imported by the commands that use it.
CLI_MUST_NOT_LOAD = ("torch", "ray", "aiohttp", "fsspec", "numpy", "rich", "httpx")


def test_the_cli_and_the_registry_start_without_heavy_imports() -> None:
    loaded = set(loaded_after_import("rollout.cli", "app.registry.sqlite"))
    bad = loaded & set(CLI_MUST_NOT_LOAD)
    assert not bad, f"importing rollout.cli and the registry loads {sorted(bad)}"


# ------------------------------------------------------------- the CLI and the local harness
# rollout/cli is the outermost layer: the operator's command line. Nothing of the product
# (app/, deployments/, the rest of rollout/) imports it, so the engine, the controller actor
# and the Serve shells never load click or the commands. rollout/local is the one-machine
# harness (the demo, local clusters, the load generator): the CLI's demo command uses it, the
# tests and benchmarks do; nothing that runs in a production cluster does, and it does not
# reach back into the CLI. The old module paths kept for one release (one-line re-export
# shims) are the only exceptions: they exist to point at the new homes.
PRODUCT = (ROOT / "app", ROOT / "deployments", ROOT / "rollout")
CLI = ROOT / "rollout" / "cli"
LOCAL = ROOT / "rollout" / "local"
SHIMS = {
    ROOT / "rollout" / f"{name}.py": target
    for name, target in {
        "cli_options": "rollout.cli.options",
        "demo": "rollout.local.demo",
        "exit_codes": "rollout.cli.exit_codes",
        "local_cluster": "rollout.local.cluster",
        "local_stack": "rollout.local.stack",
        "multinode": "rollout.local.multinode",
        "progress_bar": "rollout.cli.progress",
        "registry_cli": "rollout.cli.registry",
        "status_view": "rollout.cli.render",  # and rollout.views
        "traffic": "rollout.local.traffic",
    }.items()
}


def imported_modules(source: str) -> set[str]:
    """Dotted names a module's source imports, at any depth of the code; ``from a import b``
    counts as ``a`` and ``a.b`` (``b`` may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imports_of_package(source: str, package: str) -> set[str]:
    return {m for m in imported_modules(source) if m == package or m.startswith(package + ".")}


def product_files(*outside: Path) -> list[Path]:
    """The product's source files, less those under ``outside`` and the shims."""
    return [
        path
        for top in PRODUCT
        for path in sorted(top.rglob("*.py"))
        if path not in SHIMS and not any(path.is_relative_to(o) for o in outside)
    ]


def test_the_module_scan_sees_packages_imported_from() -> None:
    source = "from rollout import cli\n\ndef f():\n    import rollout.local.demo\n"
    assert imports_of_package(source, "rollout.cli") == {"rollout.cli"}
    assert imports_of_package(source, "rollout.local") == {"rollout.local.demo"}
    assert not imports_of_package("import rollout.client\n", "rollout.cli")


def test_the_layer_walks_find_the_packages_and_the_shims() -> None:
    assert {p.name for p in CLI.glob("*.py")} >= {"main.py", "artifacts.py", "operate.py"}
    assert ENTRY_POINT.is_file()
    assert {p.name for p in LOCAL.glob("*.py")} >= {"demo.py", "stack.py", "traffic.py"}
    assert all(path.is_file() for path in SHIMS), sorted(p for p in SHIMS if not p.is_file())


# ``python -m rollout``: the entry point above the CLI, the one module that may import it.
ENTRY_POINT = ROOT / "rollout" / "__main__.py"


@pytest.mark.parametrize(
    "path", product_files(CLI, ENTRY_POINT), ids=lambda p: str(p.relative_to(ROOT))
)
def test_nothing_outside_the_cli_imports_it(path: Path) -> None:
    bad = imports_of_package(path.read_text(), "rollout.cli")
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: rollout/cli is the top"


@pytest.mark.parametrize("path", product_files(CLI, LOCAL), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_product_does_not_import_the_local_harness(path: Path) -> None:
    bad = imports_of_package(path.read_text(), "rollout.local")
    assert not bad, (
        f"{path.relative_to(ROOT)} imports {sorted(bad)}: rollout/local is the one-machine "
        "harness, for the demo, the tests and the benchmarks"
    )


@pytest.mark.parametrize(
    "path", sorted(LOCAL.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_local_harness_does_not_import_the_cli(path: Path) -> None:
    bad = imports_of_package(path.read_text(), "rollout.cli")
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted(SHIMS), ids=lambda p: str(p.relative_to(ROOT)))
def test_an_old_path_is_only_a_shim_of_its_new_home(path: Path) -> None:
    tree = ast.parse(path.read_text())
    docstring = ast.get_docstring(tree) or ""
    assert docstring.startswith("Moved"), docstring
    assert SHIMS[path] in docstring, docstring
    for node in tree.body[1:]:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        # status_view.py points at both halves of what it was.
        assert node.module in (SHIMS[path], "rollout.views"), ast.unparse(node)


# ------------------------------------------------------------------------------ import cycles
def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(paths: list[Path], root: Path = ROOT) -> list[list[str]]:
    """The import cycles among ``paths`` (strongly connected components of more than one
    module), lazy imports inside functions included. ``from a import b`` is an edge to the
    module ``a.b`` when there is one, else to ``a``; a package's ``__init__`` run on the way
    to a submodule is no edge (it is how Python finds the submodule, not a name it reads)."""
    modules = {module_name(p, root): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
        graph[name] = {e for e in edges if e in modules and e != name}
    # Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component: list[str] = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_the_cycle_scan_finds_a_cycle_through_a_lazy_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("import a\n")
    assert import_cycles(sorted(tmp_path.glob("*.py")), tmp_path) == [["a", "b"]]


def test_no_import_cycle_among_the_projects_modules() -> None:
    # Two were rollout/cluster.py <-> rollout/exit_codes.py (the watchdog's exit code one way,
    # ClusterUnreachable the other: the errors now live in app/errors.py) and app.contracts
    # <-> app.model_family (the default families are contract vocabulary now).
    paths = sorted(
        p for pkg in ("app", "deployments", "rollout") for p in (ROOT / pkg).rglob("*.py")
    )
    assert len(paths) > 100, paths  # the walk found the code
    assert import_cycles(paths) == []
