"""The model plug-in interface: what a model family implements, and the registry of families
an application serves.

A family is service code, never artifact code: an artifact's manifest only *names* an
architecture (``architecture.name`` and ``version``) and gives its hyper-parameters; the
family registered for that name builds the module, defines the request schema clients send,
preprocesses requests, runs the forward over a batch, supplies the dry run's representative
requests and invariants, and estimates the memory a load takes. The loader, the replica and
the router only talk to this interface.

A family has two halves, so that the router (which parses requests and never loads a model)
does not import torch:

- ``ModelFamily`` (this module's dataclass), declared by a torch-free module: its names, its
  architectures' hyper-parameter bounds, its ``RequestSchema`` (pydantic/numpy), and the
  import path of its ``Network`` (torch);
- the ``Network``, imported on first use by a replica or an offline tool: building on the
  ``meta`` device, the forward, the dry run, the memory estimate.

Families are registered by import path (``AppArgs.models``: ``["app.models.ranker_mlp"]``);
the module's ``FAMILY`` attribute is the declaration. A family declares its task
(``app.tasks``): what its answers are for, which gives the HTTP route it is served on, the
dry-run checks of its answers and how a candidate's answers are compared with stable's. The
shipped families rank: a request names candidates, the answer is the top ``top_n`` of them
by score with the artifact's score bands (``app.preprocessing.LabelMapping``).

Pure module: no torch, no Ray (torch types appear only in annotations). It depends on
``app.contracts`` (the wire types, the default families) and the contracts never on it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

# The default families are contract vocabulary (the defaults of AppArgs and ReplicaConfig name
# them): re-exported from there, so this module depends on the contracts and never the reverse.
from app.contracts.vocabulary import DEFAULT_FAMILIES as DEFAULT_FAMILIES
from app.errors import ArtifactRejected, ConfigError
from app.tasks import Task

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

    from app.contracts import WireRequest
    from app.manifest import Architecture
    from app.tasks.rank import RankTensors

# Every family that ships with the service: what offline tools (``rollout verify --load``,
# ``rollout replay``) know without being told.
SHIPPED_FAMILIES: Final[tuple[str, ...]] = ("app.models.ranker_mlp", "app.models.two_tower")
# The tasks whose answers the replicas and the router carry end to end today (a loaded model's
# forward, the answer's encoding, the mirrored comparison). A family of another task is
# refused where it is registered, rather than failing at its first request.
SERVED_TASKS: Final[tuple[str, ...]] = ("rank",)
FAMILY_ATTRIBUTE: Final = "FAMILY"


@dataclass(frozen=True)
class ParamSpec:
    """An integer hyper-parameter: its default and inclusive bounds."""

    default: int
    low: int
    high: int


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str
    version: int
    params: Mapping[str, ParamSpec]
    # Oldest torch the service's build of this architecture is known to work with.
    min_torch: str = "2.1"

    def validate(self, arch: Architecture) -> dict[str, int]:
        """The manifest's params, defaults filled in; ArtifactRejected("runtime")."""
        unknown = sorted(set(arch.params) - set(self.params))
        if unknown:
            raise ArtifactRejected(
                "runtime",
                f"architecture {self.name} v{self.version}: unknown params {unknown} "
                f"(known: {sorted(self.params)})",
            )
        values: dict[str, int] = {}
        for name, ps in self.params.items():
            value = arch.params.get(name, ps.default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArtifactRejected(
                    "runtime", f"architecture param {name}: expected an integer, got {value!r}"
                )
            if not ps.low <= value <= ps.high:
                raise ArtifactRejected(
                    "runtime", f"architecture param {name}={value} outside [{ps.low}, {ps.high}]"
                )
            values[name] = value
        return values


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: what goes to a replica, and the key that buckets its user."""

    wire: WireRequest
    user_id: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, eq=False)
class EncodedBatch:
    """Requests flattened for one forward: the family's named arrays (each with one row per
    candidate, or one per request where the family says so) and the row offsets of each
    request's candidates (request i owns rows ``offsets[i]:offsets[i+1]``)."""

    arrays: Mapping[str, np.ndarray]
    offsets: np.ndarray  # int64 [requests + 1]


class RequestSchema(Protocol):
    """A family's request contract: torch-free, so the router can hold it.

    ``name`` is the manifest's ``feature_schema``: an artifact trained for this schema says
    so, and an application serves exactly one schema on its HTTP route."""

    name: str
    # Artifact files the preprocessing is read from, besides the weights and the score
    # bands (e.g. ``normalization.json``).
    preprocessing_files: tuple[str, ...]
    # How the request reads as Open Inference Protocol tensors (``/v2/models/{name}/infer``):
    # the tensors and parameters that build the family's body (``app.tasks.rank.RankTensors``
    # for a ranking family).
    oip: RankTensors

    def parse(self, raw: bytes) -> ParsedRequest:
        """Validate a body; ``app.errors.RequestInvalid`` names the first bad field."""
        ...

    def preprocessing(self, files: Mapping[str, bytes]) -> Any:
        """Parse and check the artifact's preprocessing files (ArtifactRejected("schema"))."""
        ...

    def encode(self, requests: Sequence[WireRequest], preprocessing: Any) -> EncodedBatch:
        """Validated requests -> the arrays of one forward (numpy only)."""
        ...

    def synthetic_bodies(
        self, count: int, *, seed: int, candidates: int, top_n: int
    ) -> Iterator[dict[str, Any]]:
        """Deterministic request bodies of this schema (the live load, ``rollout replay``):
        a function of the seed and the shape alone, the first ``n`` of a longer run being
        those of a shorter one."""
        ...


@dataclass(frozen=True)
class NetworkMemory:
    """What a model of given hyper-parameters holds and needs around a load, in elements of
    its compute dtype: its parameters, its largest tensor (the transient excess of moving
    tensors one at a time), and the dry run's activations per row of a batch."""

    param_count: int
    largest_tensor: int
    workspace_per_row: int


class Network(Protocol):
    """A family's torch half (imported by replicas and offline tools only)."""

    def build(self, params: Mapping[str, int]) -> nn.Module:
        """The module for validated ``params``, built on the current default device (the
        loader builds it on ``meta``: nothing allocated, nothing initialised)."""
        ...

    def forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One logit per candidate row, shape ``[rows]``, in the model's dtype."""
        ...

    def representative_batches(self, preprocessing: Any) -> list[list[WireRequest]]:
        """Service-owned warm-up requests of the type the router sends, covering the
        schema's edge cases (batch sizes, missing values, every categorical value)."""
        ...

    def check_invariants(
        self,
        score: Callable[[Sequence[WireRequest]], list[np.ndarray]],
        batch: Sequence[WireRequest],
        scores: Sequence[np.ndarray],
        tol: float,
    ) -> None:
        """The family's own dry-run invariants beyond the service's (shape, dtype,
        finiteness, ranking, batch invariance). ``score(requests)`` runs the loaded model
        and gives each request's scores in [0, 1]; ``scores`` are ``batch``'s; ``tol`` is
        the kernel rounding the compute dtype allows. Raise ArtifactRejected("dry_run")."""
        ...

    def memory(self, params: Mapping[str, int]) -> NetworkMemory: ...


@runtime_checkable
class SplitForward(Protocol):
    """The forward of a family with a head, in two halves: ``forward(model, batch)`` is
    exactly ``head_forward(model, backbone_forward(model, batch))``. The backbone's half
    reads only backbone tensors, the head's only head tensors; so a head's dry run on a
    resident backbone computes only the head's half for inputs the backbone has seen."""

    def backbone_forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What the head reads, one row per candidate row."""
        ...

    def head_forward(self, model: nn.Module, features: torch.Tensor) -> torch.Tensor:
        """One logit per row, shape ``[rows]``."""
        ...


@dataclass(frozen=True)
class ModelFamily:
    """A family's declaration (its module's ``FAMILY``)."""

    name: str
    architectures: tuple[ArchitectureSpec, ...]
    schema: RequestSchema
    # "package.module:attribute" of the Network, imported on first use.
    network_path: str
    # What its answers are for (``app.tasks.RANK`` ...): the route, the answer's checks, the
    # comparison of two answers.
    task: Task
    # The state-dict key prefixes of the family's head for given hyper-parameters (e.g.
    # ``("head.",)``): a ``head`` artifact holds exactly these tensors, a ``backbone``
    # artifact every other one. None: the family ships whole models only. A family with a
    # head gives its Network a ``SplitForward`` (the dry run of a head reuses what the
    # resident backbone computed).
    head: Callable[[Mapping[str, int]], tuple[str, ...]] | None = None
    _network: list[Network] = field(default_factory=list, repr=False, compare=False)

    @property
    def network(self) -> Network:
        if not self._network:
            module_name, _, attr = self.network_path.partition(":")
            self._network.append(getattr(importlib.import_module(module_name), attr))
        return self._network[0]

    @property
    def splits(self) -> bool:
        """Backbone and head artifacts of this family can be packed and served."""
        return self.head is not None

    def is_head_key(self, key: str, params: Mapping[str, int]) -> bool:
        prefixes = self.head(params) if self.head is not None else ()
        return any(key.startswith(prefix) for prefix in prefixes)

    def spec(self, arch: Architecture) -> ArchitectureSpec | None:
        for spec in self.architectures:
            if (spec.name, spec.version) == (arch.name, arch.version):
                return spec
        return None


def import_family(path: str, where: str = "models") -> ModelFamily:
    """The ``FAMILY`` of the module at ``path``; ConfigError naming ``where``."""
    try:
        module = importlib.import_module(path)
    except (Exception, SystemExit) as exc:  # ImportError, or the module failing at import
        raise ConfigError(
            f"{where}: cannot import model family {path!r} ({type(exc).__name__}: {exc})",
            field=where,
        ) from None
    family = getattr(module, FAMILY_ATTRIBUTE, None)
    if not isinstance(family, ModelFamily):
        raise ConfigError(
            f"{where}: module {path!r} has no {FAMILY_ATTRIBUTE} (an app.model_family.ModelFamily)",
            field=where,
        )
    return family


class Families:
    """The families one application (or tool) serves, selected by architecture name."""

    def __init__(self, families: Sequence[ModelFamily], where: str = "models") -> None:
        if not families:
            raise ConfigError(f"{where}: at least one model family is needed", field=where)
        self.families = tuple(families)
        seen: dict[tuple[str, int], str] = {}
        for family in self.families:
            if family.task.name not in SERVED_TASKS:
                raise ConfigError(
                    f"{where}: family {family.name!r} declares the task {family.task.name!r}; "
                    f"this service serves {', '.join(SERVED_TASKS)} families",
                    field=where,
                )
            for spec in family.architectures:
                key = (spec.name, spec.version)
                if key in seen:
                    raise ConfigError(
                        f"{where}: architecture {spec.name} v{spec.version} is declared by "
                        f"both {seen[key]!r} and {family.name!r}",
                        field=where,
                    )
                seen[key] = family.name

    @classmethod
    def from_paths(cls, paths: Sequence[str], where: str = "models") -> Families:
        return cls([import_family(p, f"{where}[{i}]") for i, p in enumerate(paths)], where)

    def schema(self, name: str | None = None) -> RequestSchema:
        """The request schema named ``name`` (None: the first family's)."""
        return self.serving(name).schema

    def serving(self, name: str | None = None) -> ModelFamily:
        """The family whose request schema is named ``name`` (None: the first family): the
        one an application serving that schema answers for, on its task's route."""
        if name is None:
            return self.families[0]
        for family in self.families:
            if family.schema.name == name:
                return family
        known = sorted({f.schema.name for f in self.families})
        raise ConfigError(
            f"feature_schema: {name!r} is no registered family's schema (known: {known})",
            field="feature_schema",
        )

    def resolve(self, arch: Architecture) -> tuple[ModelFamily, ArchitectureSpec]:
        """The family and spec that build ``arch``; ArtifactRejected("runtime")."""
        for family in self.families:
            spec = family.spec(arch)
            if spec is not None:
                return family, spec
        known = ", ".join(f"{s.name} v{s.version}" for f in self.families for s in f.architectures)
        raise ArtifactRejected(
            "runtime",
            f"unknown architecture {arch.name!r} version {arch.version} (known: {known})",
        )


_CACHE: dict[tuple[str, ...], Families] = {}


def families_for(paths: Sequence[str]) -> Families:
    """``Families.from_paths``, memoised: the registry of a process is built once per list."""
    key = tuple(paths)
    if key not in _CACHE:
        _CACHE[key] = Families.from_paths(key)
    return _CACHE[key]
