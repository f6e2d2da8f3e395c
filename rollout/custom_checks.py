"""A plan's custom checks read from Prometheus: each query template filled in per cohort and
asked at a window's end (rollout.plan.CustomCheck; judged by rollout.custom_judge).

``{{cohort}}`` becomes ``canary`` or ``stable``, ``{{app}}`` the Serve application (quotes and
backslashes escaped: it lands inside a PromQL string), ``{{window}}`` the window's range to the
millisecond (``increase(x[{{window}}])`` over exactly the window the judge reads). A query's
instant vector is summed over its series; no series is no value (a cohort the signal has no
data for), except a counts check's events where its trials have some: a counter that was
never incremented has no series yet, which is no events.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from app.contracts import CANARY, STABLE
from app.errors import MetricsUnavailable
from rollout.analysis import CustomSample
from rollout.metrics import PromQLSource
from rollout.plan import QUERY_PLACEHOLDERS, CustomCheck

_PLACEHOLDER = re.compile(r"\{\{\s*(" + "|".join(QUERY_PLACEHOLDERS) + r")\s*\}\}")


def _promql_string(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def render(template: str, *, cohort: str, app: str, window_s: float) -> str:
    """``template`` with its placeholders filled in (the plan refused any other)."""
    values = {
        "cohort": cohort,
        "app": _promql_string(app),
        "window": f"{max(1, round(window_s * 1000))}ms",
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


class CustomCheckReader:
    """Reads a plan's custom checks from a Prometheus server."""

    def __init__(self, source: PromQLSource, *, app: str) -> None:
        self._source = source
        self._app = app

    def _value(self, template: str, cohort: str, start: float, end: float) -> float | None:
        query = render(template, cohort=cohort, app=self._app, window_s=end - start)
        rows = self._source.query(query, end)
        if not rows:
            return None
        total = 0.0
        for row in rows:
            try:
                total += float(row["value"][1])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise MetricsUnavailable(f"{query}: an answer without a value: {row}") from exc
        return total

    def read(
        self, checks: Sequence[CustomCheck], start: float, end: float
    ) -> Mapping[str, CustomSample]:
        """Each check's reading over ``[start, end]``, per cohort."""
        found: dict[str, CustomSample] = {}
        for check in checks:
            if check.counts:
                assert check.events is not None and check.trials is not None
                events, trials = {}, {}
                for cohort in (CANARY, STABLE):
                    t = self._value(check.trials, cohort, start, end)
                    if t is None:
                        continue  # no trials: nothing to judge for this cohort
                    # A counter never incremented has no series: no events yet.
                    e = self._value(check.events, cohort, start, end)
                    events[cohort], trials[cohort] = round(e or 0.0), round(t)
                found[check.name] = CustomSample(events=events, trials=trials)
            else:
                assert check.query is not None
                values = {}
                for cohort in (CANARY, STABLE):
                    v = self._value(check.query, cohort, start, end)
                    if v is not None:
                        values[cohort] = v
                found[check.name] = CustomSample(value=values)
        return found


__all__ = ["CustomCheckReader", "render"]
