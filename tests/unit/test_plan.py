"""The rollout plan: defaults, the YAML file that mirrors them, and refusals naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from app.errors import ConfigError
from rollout.plan import RolloutPlan, load_plan, plan_from_mapping

REPO = Path(__file__).resolve().parents[2]


def test_defaults() -> None:
    plan = RolloutPlan()
    assert plan.steps == (5, 25, 50, 100)
    assert (plan.interval_s, plan.min_requests, plan.threshold) == (60, 100, 3)
    assert plan.progress_deadline_s is None and plan.deadline_s == 600  # from the estimate
    assert plan.promotion == "shift"
    assert plan.checks.error_rate_max_ratio == 3.0 and plan.checks.p99_max_ratio == 1.5
    assert plan.checks.error_rate_floor == 0.01
    assert not plan.gates.pause_before_promotion and plan.gates.pause_before_steps == ()
    assert [plan.step_bp(i) for i in range(4)] == [500, 2500, 5000, 10_000]


def test_configs_rollout_yaml_mirrors_the_defaults() -> None:
    assert load_plan(REPO / "configs" / "rollout.yaml") == RolloutPlan()


def test_plans_are_frozen() -> None:
    with pytest.raises(pydantic.ValidationError):
        RolloutPlan().threshold = 5  # type: ignore[misc]


def test_load_plan_reads_yaml_and_fills_defaults(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(
        "steps: [1, 10.5, 50]\ninterval_s: 5\nprogress_deadline_s: 30\npromotion: in_place\n"
        "gates: {pause_before_steps: [50], pause_before_promotion: true}\n"
        "checks: {p99_max_ms: null}\n"
    )
    plan = load_plan(path)
    assert plan.steps == (1, 10.5, 50) and plan.step_bp(1) == 1050
    assert plan.promotion == "in_place" and plan.gates.pause_before_promotion
    assert plan.gate_before_step(2) and not plan.gate_before_step(1)
    assert plan.checks.p99_max_ms is None and plan.checks.success_rate_min == 0.98
    assert plan.min_requests == 100
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_plan(empty) == RolloutPlan()


def test_canary_replicas_follow_the_weight() -> None:
    scaling = RolloutPlan(canary_scaling={"min_replicas": 1, "max_replicas": 4}).canary_scaling
    assert [scaling.replicas_for(p) for p in (0, 5, 25, 26, 50, 100)] == [1, 1, 1, 2, 2, 4]


@pytest.mark.parametrize(
    ("override", "field", "message"),
    [
        ({"steps": []}, "steps", "at least 1 item"),
        ({"steps": [5, 5]}, "steps", "strictly increasing"),
        ({"steps": [50, 25]}, "steps", "strictly increasing"),
        ({"steps": [0, 5]}, "steps", "(0, 100]"),
        ({"steps": [5, 101]}, "steps", "(0, 100]"),
        ({"steps": [0.001]}, "steps", "basis points"),
        ({"interval_s": 0}, "interval_s", "greater than 0"),
        ({"min_requests": 0}, "min_requests", "greater than or equal to 1"),
        ({"threshold": 0}, "threshold", "greater than or equal to 1"),
        ({"interval_s": 400, "progress_deadline_s": 600}, "progress_deadline_s", "at least twice"),
        ({"promotion": "yolo"}, "promotion", "'shift' or 'in_place'"),
        ({"checks": {"success_rate_min": 1.5}}, "checks.success_rate_min", "less than"),
        ({"checks": {"p99_max_ms": -1}}, "checks.p99_max_ms", "greater than 0"),
        ({"checks": {"error_rate_max_ratio": 0.5}}, "checks.error_rate_max_ratio", "1"),
        ({"checks": {"error_rate_floor": 2}}, "checks.error_rate_floor", "less than"),
        ({"checks": {"p99_max_ratio": 0.9}}, "checks.p99_max_ratio", "1"),
        ({"checks": {"p99_slack_ms": -1}}, "checks.p99_slack_ms", "greater than"),
        (
            {
                "checks": {
                    "success_rate_min": None,
                    "p99_max_ms": None,
                    "error_rate_max_ratio": None,
                    "p99_max_ratio": None,
                }
            },
            "checks",
            "at least one check",
        ),
        ({"gates": {"pause_before_steps": [7]}}, "gates.pause_before_steps", "not one of steps"),
        ({"gates": {"pause_before_promotion": "maybe"}}, "gates.pause_before_promotion", "bool"),
        ({"canary_scaling": {"min_replicas": 0}}, "canary_scaling.min_replicas", "greater"),
        (
            {"canary_scaling": {"min_replicas": 3, "max_replicas": 2}},
            "canary_scaling.max_replicas",
            "below min_replicas",
        ),
        ({"canary_scaling": {"idle_replicas": -1}}, "canary_scaling.idle_replicas", "greater"),
        ({"stepz": [5]}, "stepz", "Extra inputs are not permitted"),
    ],
)
def test_invalid_plans_are_refused_naming_the_field(
    override: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        plan_from_mapping(override, source="test.yaml")
    assert caught.value.ids["field"] == field
    assert caught.value.category == "config"
    assert f"test.yaml: invalid rollout plan: {field}: " in str(caught.value)
    assert message in str(caught.value)
    # The constructor refuses the same plan with pydantic's own error.
    with pytest.raises(pydantic.ValidationError):
        RolloutPlan.model_validate(override)


def test_load_plan_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read rollout plan"):
        load_plan(tmp_path / "missing.yaml")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("steps: [5, 25\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_plan(bad_yaml)
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- 5\n- 25\n")
    with pytest.raises(ConfigError, match="is a mapping, got list"):
        load_plan(a_list)
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text("threshold: 0\n")
    with pytest.raises(ConfigError, match=r"invalid\.yaml: invalid rollout plan: threshold"):
        load_plan(invalid)


def test_a_plan_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"\xff\xfesteps: [5]\n")
    with pytest.raises(ConfigError, match=r"not a UTF-8 text file \(byte 0\)"):
        load_plan(path)


def test_a_shadow_block_is_validated_field_by_field() -> None:
    plan = plan_from_mapping({"shadow": {}})
    assert plan.shadow is not None and plan.shadow.fraction_bp == 1000
    # The example in configs/rollout.yaml spells out the defaults.
    text = (REPO / "configs" / "rollout.yaml").read_text()
    block = []
    for line in text.split("# Example", 1)[1].splitlines()[1:]:
        if not line.startswith("#   "):
            break
        block.append(line.removeprefix("#   "))
    example = "\n".join(block)
    assert plan_from_mapping(yaml.safe_load(example)).shadow == plan.shadow
    for bad, field in (
        ({"fraction": 0}, "shadow.fraction"),
        ({"fraction": 0.00005}, "shadow.fraction"),
        ({"tolerance": 1.5}, "shadow.tolerance"),
        ({"rbo_p": 1.0}, "shadow.rbo_p"),
        ({"top_k": 0}, "shadow.top_k"),
        ({"mirror": True}, "shadow.mirror"),
    ):
        with pytest.raises(ConfigError) as caught:
            plan_from_mapping({"shadow": bad})
        assert caught.value.ids.get("field") == field, (bad, caught.value)
