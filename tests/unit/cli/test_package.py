"""The ``rollout`` command line as a package (rollout/cli/): it keeps the names of the single
module it was, every family's commands are on the group, and the old import paths of what
moved (the CLI's modules, the one-machine harness, the exceptions) still name the same
objects."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import click

import rollout.cli
from app.errors import ClusterUnreachable
from rollout import cluster
from rollout.cli import artifacts, operate
from rollout.cli.exit_codes import EXIT_UNAVAILABLE, exit_code_for
from rollout.cli.main import _Commands

ROOT = Path(__file__).resolve().parents[3]

# Old path -> new home: the shims kept for one release.
MOVED_MODULES = {
    "rollout.cli_options": "rollout.cli.options",
    "rollout.demo": "rollout.local.demo",
    "rollout.exit_codes": "rollout.cli.exit_codes",
    "rollout.local_cluster": "rollout.local.cluster",
    "rollout.local_stack": "rollout.local.stack",
    "rollout.multinode": "rollout.local.multinode",
    "rollout.progress_bar": "rollout.cli.progress",
    "rollout.registry_cli": "rollout.cli.registry",
    "rollout.traffic": "rollout.local.traffic",
}
# The exceptions that moved into app/errors.py, by the module they were defined in.
MOVED_EXCEPTIONS = {
    "app/api.py": ("RequestInvalid", "BodyTooLarge"),
    "app/body_reads.py": ("BodyReadTimeout", "BodyReadsFull"),
    "app/client.py": ("RankerClientError", "RankerHTTPError", "RetriesExhausted"),
    "app/faults.py": ("InjectedFault",),
    "app/generations.py": ("NotReady",),
    "app/load_control.py": ("LoadCancelled",),
    "app/loader.py": ("BackboneFreed",),
    "app/polling.py": ("WaitTimeout",),
    "app/replica.py": ("ReplicaNotReady", "StartupLoadFailed"),
    "rollout/cluster.py": ("ClusterUnreachable", "ControllerNotRunning"),
    "rollout/metrics.py": ("MetricsUnavailable",),
    "rollout/targets.py": ("TargetConflict",),
}


def test_rollout_cli_main_is_the_function_the_entry_point_names() -> None:
    # Importing the submodule rollout/cli/main.py binds the package's ``main`` to it; the
    # package binds it back to the function.
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attribute = scripts["rollout"].partition(":")
    entry = getattr(importlib.import_module(module), attribute)
    assert entry is rollout.cli.main is sys.modules["rollout.cli.main"].main
    assert callable(entry)
    assert rollout.cli.cli is sys.modules["rollout.cli.main"].cli


def test_every_family_of_commands_is_on_the_group() -> None:
    group = rollout.cli.cli
    ctx = click.Context(group, info_name="rollout")
    families = [command.name for command in (*artifacts.COMMANDS, *operate.COMMANDS)]
    assert len(families) == len(set(families)), families
    assert set(group.list_commands(ctx)) == {*families, *_Commands.LAZY}
    assert {"pack", "verify", "replay", "keygen", "make-demo-artifacts"} <= set(families)
    assert {"controller", "start", "status", "pause", "resume", "promote", "abort"} <= set(families)
    assert {"rollback", "standby", "history"} <= set(families)


def test_the_cluster_watchdog_exits_as_main_does_for_an_unreachable_cluster() -> None:
    # rollout/cluster.py does not import the CLI's table (it is below the CLI): its own
    # constant must stay the code main() gives ClusterUnreachable.
    assert cluster.EXIT_ON_TIMEOUT == EXIT_UNAVAILABLE == exit_code_for(ClusterUnreachable("x"))


def test_old_module_paths_name_the_objects_of_the_new_ones() -> None:
    # In a fresh interpreter: the harness's modules load the HTTP clients.
    code = (
        "import importlib, json, sys\n"
        "moved = json.loads(sys.argv[1])\n"
        "bad = []\n"
        "for old, new in moved.items():\n"
        "    o, n = importlib.import_module(old), importlib.import_module(new)\n"
        "    names = getattr(n, '__all__', [k for k in vars(n) if not k.startswith('_')])\n"
        "    bad += [f'{old}.{k}' for k in names if getattr(o, k, None) is not getattr(n, k)]\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(MOVED_MODULES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_status_view_path_names_both_halves() -> None:
    import rollout.status_view as old
    from rollout import views
    from rollout.cli import render

    for name in ("wire", "fields_of", "rollout_summary", "controller_status", "replica_rows"):
        assert getattr(old, name) is getattr(views, name)
    for name in ("render_status", "standby_lines", "trust_disagreement"):
        assert getattr(old, name) is getattr(render, name)


def test_every_moved_exception_is_still_imported_where_it_was_defined() -> None:
    # Checked on the source: importing app/loader.py would load torch. A module that became
    # a shim of its own (app/loader.py, app/load_control.py) re-exports it from its new home,
    # which imports it from app.errors.
    errors = ast.parse((ROOT / "app" / "errors.py").read_text())
    defined = {node.name for node in errors.body if isinstance(node, ast.ClassDef)}
    for path, names in MOVED_EXCEPTIONS.items():
        imported = {
            alias.asname or alias.name
            for node in ast.parse((ROOT / path).read_text()).body
            if isinstance(node, ast.ImportFrom)
            and node.module is not None
            and (node.module == "app.errors" or node.module.startswith("app.loading."))
            for alias in node.names
        }
        assert set(names) <= defined, (path, set(names) - defined)
        assert set(names) <= imported, (path, set(names) - imported)


def test_the_exception_tree_in_the_docstring_names_every_exception() -> None:
    source = (ROOT / "app" / "errors.py").read_text()
    tree = ast.parse(source)
    drawn = ast.get_docstring(tree) or ""
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert [name for name in classes if f" {name}" not in drawn] == []
