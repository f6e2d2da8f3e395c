"""The layering the code promises, checked on the code itself.

- app/ is the domain core: it imports neither deployments/ nor rollout/ nor Ray, not even
  lazily inside a function (checked on the source), and importing all of it loads no Ray
  (checked in a fresh interpreter, so a transitive import counts too).
- The pure modules (manifest, generations, contracts, plan, state, machine, analysis) load no
  Ray, no torch and no database driver when imported on their own, in a fresh interpreter.
- The contracts (app/contracts/, one module per boundary) import nothing of app/ but each other
  and app.errors: the model families, the loader and the rest depend on them, never the
  reverse (the default families are contract vocabulary, re-exported by app.model_family).
"""

from __future__ import annotations

import ast
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
    "app.routing",
    "app.standby",
    "app.divergence",
    "app.shadow",
    # A family's declaration and request schema: the router holds them.
    "app.model_family",
    "app.preprocessing",
    # What reads manifests only (rollout verify, registry register) must not pay for torch.
    "app.compatibility",
    "app.models.ranker_mlp",
    "app.models.ranker_mlp.features",
    "app.models.two_tower",
    "app.models.two_tower.features",
    "rollout.plan",
    "rollout.state",
    "rollout.persisted",
    "rollout.machine",
    "rollout.analysis",
    "rollout.sequential",
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


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_loads_no_ray_torch_or_database(module: str) -> None:
    bad = set(loaded_after_import(module)) & set(PURE_MUST_NOT_LOAD)
    assert not bad, f"importing {module} loads {sorted(bad)}"


CONTRACTS = CORE / "contracts"
CONTRACTS_MAY_IMPORT = ("app.contracts", "app.errors")


def imported_modules(source: str) -> set[str]:
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
    inside = {m for m in imported_modules(path.read_text()) if m.split(".")[0] == "app"}
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


def unit_test_modules() -> list[str]:
    return [f"tests.unit.{p.stem}" for p in sorted(UNIT_TESTS.glob("*.py"))]


@pytest.mark.parametrize(
    "path", sorted(UNIT_TESTS.glob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
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
