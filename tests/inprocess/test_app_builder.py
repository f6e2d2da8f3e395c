"""deployments/app.py's builder, called as Serve calls it: the arguments a config gives are
checked and turned into each deployment's options (binding deploys nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.contracts import AppArgs
from app.errors import ConfigError
from app.models.ranker_mlp import RANKER_MLP
from app.models.two_tower import TWO_TOWER
from app.packing import PackResult
from deployments.app import PROJECT_ROOT, build_app, replica_config
from tests.artifacts import pack_family


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PackResult]:
    root: Path = tmp_path_factory.mktemp("families")
    return {name: pack_family(root, name, seed=3) for name in (RANKER_MLP, TWO_TOWER)}


def test_the_app_refuses_a_cohort_target_of_another_schema_naming_it(
    packed: dict[str, PackResult],
) -> None:
    args = {
        "models": ["app.models.two_tower"],
        "stable": {"target": packed[TWO_TOWER].target(1).model_dump(mode="json")},
        "canary": {"target": packed[RANKER_MLP].target(1).model_dump(mode="json")},
    }
    with pytest.raises(ConfigError, match=r"args\.canary\.target\.feature_schema") as info:
        build_app(args)
    assert info.value.ids["field"] == "args.canary.target.feature_schema"
    with pytest.raises(ConfigError, match=r"args\.models\[0\]: cannot import"):
        build_app({**args, "models": ["acme.missing"]})
    args["canary"] = {}
    build_app(args)  # binds: nothing is deployed


def test_app_args_trust_reaches_replicas_with_paths_resolved_against_the_project() -> None:
    args = AppArgs.model_validate(
        {
            "trust_key": "var/keys/old-ed25519.pub",
            "trust": {
                "keys": ["/etc/ranker/release-ec.pub"],
                "certificate_chains": ["var/keys/ca.crt"],
                "keyless": [
                    {
                        "identity": "release@example.com",
                        "oidc_issuer": "https://accounts.google.com",
                    }
                ],
                "sigstore_trust_config": "var/keys/trust-config.json",
            },
        }
    )
    trust = replica_config(args, "canary", None).signature_trust
    assert trust.keys == [
        str(PROJECT_ROOT / "var/keys/old-ed25519.pub"),
        "/etc/ranker/release-ec.pub",
    ]
    assert trust.certificate_chains == [str(PROJECT_ROOT / "var/keys/ca.crt")]
    assert trust.sigstore_trust_config == str(PROJECT_ROOT / "var/keys/trust-config.json")
    assert trust.keyless[0].identity == "release@example.com"
