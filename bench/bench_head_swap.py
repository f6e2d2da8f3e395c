"""A head-only swap against a full-model swap, side by side in one run, on one replica while
it serves.

One replica (``app.replica.RankerReplica`` in this process: its reconciler, loader, verified
cache and generation holder, as a Serve replica runs them, without Serve around it) serves a
closed request loop. It swaps between two whole ``ranker-mlp`` models (full-a, full-b) and
between two heads (head-a, head-b) on one resident backbone (rb) of the same architecture:
``head_layers`` top layers and the output layer form the head, the rest (at least 20x the
head's bytes) the backbone. Every artifact is in the verified cache before the swaps (the
fetch is not what is compared). For each swap:

- install time: from the new target (a user_config with it) to the new generation serving;
- peak memory added: the process's peak RSS over the swap (until the old generation is
  cleaned up) minus its peak over a window without a swap (as long, up to 5 s), serving the
  same loop (the kernel's VmHWM, reset through /proc/self/clear_refs);
- p99 of the requests that started during the swap against the p99 of steady state.

One swap of each kind there and back comes first and is not measured: a replica's first load
beside a served model pays once what its load thread keeps (the math library's per-thread
buffers, a few MiB), as every replica that has swapped before has paid it.

    .venv/bin/python bench/bench_head_swap.py [--quick] [--rounds N]

Its last line is one JSON object with ``head_bytes``, ``full_bytes``, ``install_time_ratio``
(head-only / full), ``head_peak_added_bytes``, ``full_peak_added_bytes``, ``p99_ratio_head``
and ``p99_ratio_full``; the line before it holds the rows for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from app.cache import ArtifactCache  # noqa: E402
from app.demo_artifacts import DEMO_MODEL, family_weights, write_family_source  # noqa: E402
from app.manifest import Architecture, BackboneRef  # noqa: E402
from app.model_family import SHIPPED_FAMILIES, families_for  # noqa: E402
from app.models.ranker_mlp import RANKER_MLP  # noqa: E402
from app.models.ranker_mlp.features import FEATURE_NAMES, FEATURE_SCHEMA  # noqa: E402
from app.packing import PackResult, pack_artifact  # noqa: E402
from app.preprocessing import LABEL_MAPPING_FILE, NORMALIZATION_FILE  # noqa: E402
from app.replica import RankerReplica  # noqa: E402
from app.request_bodies import rank_bodies  # noqa: E402

# 169 layers of 2048 (16 MiB each): the head is the top 8 and the output layer (128 MiB), the
# backbone the other 160 (2.5 GiB, 20x the head). --quick: the same shape at width 1024.
FULL = {"hidden_dim": 2048, "num_layers": 169, "context_dim": 8, "head_layers": 8}
QUICK = {**FULL, "hidden_dim": 1024}
CANDIDATES = 2  # per request: on two cores a forward through 169 wide layers is not cheap
SEED_A, SEED_B = 7, 8
# After a swap, before its steady window: what the old generation's release costs (unmapping
# GiBs) is not steady state.
SETTLE_S = 3.0


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    # "5" resets the peak resident set size (VmHWM) to the current one (Linux 4.0+).
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def pack_all(work: Path, params: dict[str, int]) -> dict[str, PackResult]:
    """full-a, full-b (whole models of seeds A and B); rb (seed A's backbone), head-a (seed
    A's head: with rb it is full-a) and head-b (seed B's head). One normalization for all."""
    arch = Architecture(name=RANKER_MLP, version=1, params=params)
    family, spec = families_for(SHIPPED_FAMILIES).resolve(arch)
    validated = spec.validate(arch)
    store, sources = work / "store", work / "src"
    packed: dict[str, PackResult] = {}

    def pack(name: str, weights: dict[str, torch.Tensor], **kind: Any) -> None:
        src = sources / name
        write_family_source(
            src, arch, seed=SEED_A, feature_names=FEATURE_NAMES, schema=FEATURE_SCHEMA,
            weights=weights,
        )  # fmt: skip
        if kind.get("kind") == "backbone":
            for extra in (NORMALIZATION_FILE, LABEL_MAPPING_FILE):  # the heads' files
                (src / extra).unlink()
        packed[name] = pack_artifact(
            src, store / name, model=DEMO_MODEL, artifact_id=name,
            feature_schema=FEATURE_SCHEMA, **kind,
        )  # fmt: skip
        shutil.rmtree(src)

    for seed, suffix in ((SEED_A, "a"), (SEED_B, "b")):
        weights = family_weights(arch, seed=seed)
        pack(f"full-{suffix}", weights)
        head = {k: t for k, t in weights.items() if family.is_head_key(k, validated)}
        if suffix == "a":
            backbone = {k: t for k, t in weights.items() if k not in head}
            pack("rb", backbone, kind="backbone")
        ref = BackboneRef(artifact_id="rb", manifest_sha256=packed["rb"].manifest_sha256)
        pack(f"head-{suffix}", head, kind="head", backbone=ref)
        del weights, head
    return packed


class RequestLoop:
    """One client calling the replica back to back; (start, latency) of each answer."""

    def __init__(self, replica: RankerReplica) -> None:
        (body,) = rank_bodies(1, seed=3, candidates=CANDIDATES, top_n=CANDIDATES)
        self._wire = replica.schema.parse(json.dumps(body).encode()).wire
        self._replica = replica
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                self._replica.rank([self._wire])
            except Exception:
                self.errors += 1
                continue
            self.samples.append((started, time.perf_counter() - started))

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def latencies(self, start: float, end: float) -> list[float]:
        return [lat for t, lat in self.samples if start <= t < end]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def config(work: Path, packed: PackResult, revision: int) -> dict[str, Any]:
    return {
        "cohort": "stable",
        "cache_dir": str(work / "cache"),
        "models": ["app.models.ranker_mlp"],
        "loading": {"model": DEMO_MODEL},
        "target": packed.target(revision).model_dump(mode="json"),
    }


@contextmanager
def serving(work: Path, first: PackResult) -> Iterator[RankerReplica]:
    replica = RankerReplica("bench-head-swap")
    try:
        replica.reconfigure(config(work, first, 1))
        deadline = time.monotonic() + 900
        while replica.report().actual_artifact != first.artifact_id:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{first.artifact_id} did not load: {replica.report()}")
            time.sleep(0.05)
        yield replica
    finally:
        replica.close()


def swap(
    replica: RankerReplica, loop: RequestLoop, work: Path, to: PackResult, revision: int
) -> dict[str, float]:
    """One swap: install time, peak RSS added over it, the latencies that started in it."""
    holder = replica._holder
    reset_peak()
    before = rss()
    started = time.perf_counter()
    replica.reconfigure(config(work, to, revision))
    while (holder.current.artifact_id if holder.current else None) != to.artifact_id:
        time.sleep(0.001)
    installed = time.perf_counter()
    holder.wait_idle(300)  # the old generation cleaned up: its memory is back
    ended = time.perf_counter()
    return {
        "install_s": installed - started,
        "window_s": ended - started,
        "peak_added": peak() - before,
        "start": started,
        "end": ended,
    }


def steady(loop: RequestLoop, seconds: float) -> dict[str, float]:
    """The same measurements over a window with no swap."""
    reset_peak()
    before = rss()
    started = time.perf_counter()
    time.sleep(seconds)
    return {"peak_added": peak() - before, "start": started, "end": time.perf_counter()}


def measure(
    work: Path, packed: dict[str, PackResult], pair: tuple[str, str], rounds: int
) -> dict[str, Any]:
    first, second = packed[pair[0]], packed[pair[1]]
    with serving(work, first) as replica, RequestLoop(replica) as loop:
        time.sleep(2.0)  # the loop warmed up
        # One swap there and back first, not measured: a replica's first load beside a
        # served model pays once what its load thread keeps (app.reconciler.LoweredThread).
        swap(replica, loop, work, second, 2)
        swap(replica, loop, work, first, 3)
        swaps, steadies = [], []
        revision = 3
        for i in range(rounds * 2):
            revision += 1
            done = swap(replica, loop, work, second if i % 2 == 0 else first, revision)
            swaps.append(done)
            time.sleep(SETTLE_S)
            steadies.append(steady(loop, min(5.0, max(1.0, done["window_s"]))))
        report = replica.report()
        errors = loop.errors
    swap_latencies = [lat for s in swaps for lat in loop.latencies(s["start"], s["end"])]
    steady_latencies = [lat for s in steadies for lat in loop.latencies(s["start"], s["end"])]
    added = [
        max(0, s["peak_added"] - w["peak_added"]) for s, w in zip(swaps, steadies, strict=True)
    ]
    return {
        "install_s": statistics.median(s["install_s"] for s in swaps),
        "peak_added": max(added),
        "p99_swap_s": p99(swap_latencies),
        "p99_steady_s": p99(steady_latencies),
        "swap_requests": len(swap_latencies),
        "steady_requests": len(steady_latencies),
        "errors": errors,
        "backbone_loaded_bytes": report.timings.backbone_loaded_bytes,
    }


def run_phase(work: Path, pair: tuple[str, str], rounds: int) -> dict[str, Any]:
    """``measure`` in a process of its own, with glibc's mmap threshold fixed at 1 MiB: each
    larger allocation is mapped on its own and unmapped when freed, so the RSS follows the
    bytes held (with the default, dynamic threshold, memory freed earlier in a process stays
    in its heap and serves later allocations unseen, or shows up in another phase)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run(
        [sys.executable, __file__, "--phase", ",".join(pair), "--work", str(work),
         "--rounds", str(rounds)],
        env=env, capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"phase {pair} failed: {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a narrower model, one round")
    parser.add_argument("--rounds", type=int, default=None, help="swap pairs per kind")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # one side, in-process
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.phase is not None:
        first, second = args.phase.split(",")
        packed = json.loads((args.work / "packed.json").read_text())
        results = {k: PackResult(**{**v, "out_dir": Path(v["out_dir"])}) for k, v in packed.items()}
        print(json.dumps(measure(args.work, results, (first, second), rounds)))
        return
    params = QUICK if args.quick else FULL
    work = Path(tempfile.mkdtemp(prefix="bench-head-swap-"))
    try:
        packed = pack_all(work, params)
        (work / "packed.json").write_text(
            json.dumps({k: {**asdict(v), "out_dir": str(v.out_dir)} for k, v in packed.items()})
        )
        cache = ArtifactCache(work / "cache")
        for p in packed.values():  # warm: the swaps compare loads, not fetches
            cache.fetch_verified(p.manifest_uri, p.manifest_sha256)
        head_bytes = packed["head-b"].out_dir.joinpath("weights.safetensors").stat().st_size
        full_bytes = packed["full-b"].out_dir.joinpath("weights.safetensors").stat().st_size
        backbone_bytes = packed["rb"].out_dir.joinpath("weights.safetensors").stat().st_size
        full = run_phase(work, ("full-a", "full-b"), rounds)
        head = run_phase(work, ("head-a", "head-b"), rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = head["install_s"] / full["install_s"]
    p99_head = head["p99_swap_s"] / head["p99_steady_s"]
    p99_full = full["p99_swap_s"] / full["p99_steady_s"]
    mib = 1 << 20
    print(
        f"ranker-mlp {params}: full {full_bytes / mib:.0f} MiB, backbone "
        f"{backbone_bytes / mib:.0f} MiB ({backbone_bytes / head_bytes:.2f}x the head), head "
        f"{head_bytes / mib:.0f} MiB; {rounds * 2} swaps of each kind\n"
        f"install: head {head['install_s']:.2f} s, full {full['install_s']:.2f} s "
        f"(ratio {ratio:.3f}) | peak RSS added: head {head['peak_added'] / mib:.0f} MiB "
        f"({head['peak_added'] / head_bytes:.2f}x the head), full "
        f"{full['peak_added'] / mib:.0f} MiB ({full['peak_added'] / full_bytes:.2f}x the model)\n"
        f"p99 during swaps vs steady: head {head['p99_swap_s'] * 1e3:.0f}/"
        f"{head['p99_steady_s'] * 1e3:.0f} ms ({head['swap_requests']} requests in swaps), "
        f"full {full['p99_swap_s'] * 1e3:.0f}/{full['p99_steady_s'] * 1e3:.0f} ms "
        f"({full['swap_requests']}); failed requests {head['errors'] + full['errors']}",
        flush=True,
    )
    label = f"{full_bytes / (1 << 30):.2f} GiB model, {head_bytes / mib:.0f} MiB head"
    rows = [
        {"measurement": f"head swap vs full swap ({label}): time to install",
         "value": round(head["install_s"], 3), "baseline": round(full["install_s"], 3),
         "unit": "s", "ratio": round(ratio, 3), "goal": "<= 0.2x"},
        {"measurement": "head swap: peak memory added vs the head's bytes",
         "value": round(head["peak_added"] / mib, 1), "baseline": round(head_bytes / mib, 1),
         "unit": "MiB", "ratio": round(head["peak_added"] / head_bytes, 3), "goal": "<= 1.1x"},
        {"measurement": "full swap: peak memory added vs the model's bytes",
         "value": round(full["peak_added"] / mib, 1), "baseline": round(full_bytes / mib, 1),
         "unit": "MiB", "ratio": round(full["peak_added"] / full_bytes, 3), "goal": ""},
        {"measurement": "head swap: p99 of requests during the swap vs steady state",
         "value": round(head["p99_swap_s"] * 1e3, 1),
         "baseline": round(head["p99_steady_s"] * 1e3, 1), "unit": "ms",
         "ratio": round(p99_head, 3), "goal": ""},
        {"measurement": "full swap: p99 of requests during the swap vs steady state",
         "value": round(full["p99_swap_s"] * 1e3, 1),
         "baseline": round(full["p99_steady_s"] * 1e3, 1), "unit": "ms",
         "ratio": round(p99_full, 3), "goal": ""},
    ]  # fmt: skip
    print(json.dumps({"bench": "head_swap", "rows": rows}))
    print(
        json.dumps(
            {
                "head_bytes": head_bytes,
                "full_bytes": full_bytes,
                "install_time_ratio": round(ratio, 4),
                "head_peak_added_bytes": head["peak_added"],
                "full_peak_added_bytes": full["peak_added"],
                "p99_ratio_head": round(p99_head, 3),
                "p99_ratio_full": round(p99_full, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
