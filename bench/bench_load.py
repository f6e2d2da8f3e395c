"""Loading a multi-GB artifact: cold (fetch into an empty cache, verify, load) and warm (a
cache hit, loaded), each against `sha256sum` of the same bytes in the same run; peak RSS
against the weights; the dry run timed apart (model compute, not I/O).

Each load runs in a process of its own, so its peak RSS (VmHWM) is its own. The source files
are in the page cache for both sides alike ("cold" is an empty artifact cache, not a cold
disk). The whole-file loader this replaced (read the file into memory, hash it, deserialize a
copy) runs beside it for comparison.

    .venv/bin/python bench/bench_load.py [--gib 2] [--rounds 3] [--quick]

Its last line is one JSON object with `weights_gib`, `cold_ratio_vs_sha256sum`,
`warm_ratio_vs_sha256sum` and `peak_rss_ratio`; the line before it holds the rows for
bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.demo_artifacts import DEMO_MODEL, write_ranker_source  # noqa: E402
from app.models.ranker_mlp.features import FEATURE_SCHEMA  # noqa: E402
from app.packing import PackResult, pack_artifact  # noqa: E402

HIDDEN = 4096  # each hidden layer is one 64 MiB fp32 tensor

# One load in a fresh process: the cache at argv[1] (emptied first when argv[4] is "cold"),
# the artifact at argv[2] with digest argv[3]; "whole-file" reads the weights the old way.
PROBE = r"""
import json, os, shutil, sys, time
from pathlib import Path
import torch
torch.set_num_threads(max(1, os.cpu_count() or 1))
from app.cache import ArtifactCache
from app.compatibility import WEIGHTS_FILES
from app.loading.candidate import CandidateLoad, load_verified

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def hwm():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmHWM:"))

cache_root, uri, digest, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if mode == "cold":
    shutil.rmtree(cache_root, ignore_errors=True)
cache = ArtifactCache(cache_root)
before = rss()
started = time.perf_counter()
# As a replica loads: a cold fetch feeds the weights into the model while it hashes them.
prepared = CandidateLoad(device=torch.device("cpu")) if mode != "whole-file" else None
artifact = cache.fetch_verified(uri, digest, sink=prepared)
fetched = time.perf_counter()
if mode == "whole-file":
    import hashlib, safetensors.torch
    # The loader this replaced: the file read whole into bytes, hashed, then deserialized.
    name = WEIGHTS_FILES["safetensors"]
    data = artifact.file_path(name).read_bytes()
    if hashlib.sha256(data).hexdigest() != artifact.manifest.file(name).sha256:
        raise SystemExit("digest mismatch")
    state = safetensors.torch.load(data)
    done = time.perf_counter()
    weights = sum(t.numel() * t.element_size() for t in state.values())
    dry_run = 0.0
else:
    model = load_verified(artifact, prepared=prepared)
    weights = model.param_bytes
    dry_run = model.timings["dry_run"]
    done = time.perf_counter() - dry_run
print(json.dumps({
    "fetch_s": fetched - started, "load_s": done - fetched, "dry_run_s": dry_run,
    "peak_added": hwm() - before, "weights": weights, "cached": artifact.cached,
}))
"""


def pack(root: Path, gib: float) -> PackResult:
    # The first layer is narrow (the features): one more hidden layer makes up for it.
    layers = math.ceil(gib * (1 << 30) / (HIDDEN * HIDDEN * 4)) + 1
    src = root / "src"
    write_ranker_source(
        src, seed=1, params={"hidden_dim": HIDDEN, "num_layers": layers, "context_dim": 16}
    )
    return pack_artifact(
        src,
        root / "artifact",
        model=DEMO_MODEL,
        artifact_id=f"bench-load-{layers}",
        feature_schema=FEATURE_SCHEMA,
    )


def sha256sum_s(files: list[Path]) -> float:
    started = time.perf_counter()
    subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def probe(cache_root: Path, packed: PackResult, mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(cache_root), packed.manifest_uri,
         packed.manifest_sha256, mode],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{mode} load failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="weights size (default 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="bench-load-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        packed = pack(root, args.gib)
        files = sorted(p for p in packed.out_dir.iterdir() if p.name != "manifest.json")
        total = sum(p.stat().st_size for p in files)
        cache_root = root / "cache"
        sha256sum_s(files)  # page cache warm for both sides
        sums, cold, warm, whole = [], [], [], []
        for _ in range(rounds):
            sums.append(sha256sum_s(files))
            cold.append(probe(cache_root, packed, "cold"))
            warm.append(probe(cache_root, packed, "warm"))
            whole.append(probe(cache_root, packed, "whole-file"))
            shutil.rmtree(cache_root, ignore_errors=True)
    base = statistics.median(sums)

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    cold_s = statistics.median(r["fetch_s"] + r["load_s"] for r in cold)
    warm_s = statistics.median(r["fetch_s"] + r["load_s"] for r in warm)
    whole_s = statistics.median(r["fetch_s"] + r["load_s"] for r in whole)
    weights = cold[0]["weights"]
    peak_ratio = max(r["peak_added"] for r in cold + warm) / weights
    whole_peak_ratio = max(r["peak_added"] for r in whole) / weights
    gib = total / (1 << 30)
    print(
        f"{gib:.2f} GiB artifact ({weights / (1 << 30):.2f} GiB of weights), {rounds} round(s)\n"
        f"sha256sum {base:.2f} s | cold fetch+verify+load {cold_s:.2f} s "
        f"(fetch {med(cold, 'fetch_s'):.2f} + load {med(cold, 'load_s'):.2f}) | warm "
        f"{warm_s:.2f} s | whole-file loader, warm {whole_s:.2f} s\n"
        f"dry run {med(cold, 'dry_run_s'):.2f} s (apart) | peak RSS added: streamed "
        f"{peak_ratio:.2f}x the weights, whole-file {whole_peak_ratio:.2f}x",
        flush=True,
    )
    label = f"{gib:.1f} GiB"
    rows = [
        {"measurement": f"load {label}, cold cache (fetch+verify+load) vs sha256sum",
         "value": round(cold_s, 2), "baseline": round(base, 2), "unit": "s",
         "ratio": round(cold_s / base, 2), "goal": "<= 1.5x"},
        {"measurement": f"load {label}, warm cache vs sha256sum",
         "value": round(warm_s, 2), "baseline": round(base, 2), "unit": "s",
         "ratio": round(warm_s / base, 2), "goal": "<= 1.2x"},
        {"measurement": f"load {label}, whole-file loader (before) vs sha256sum",
         "value": round(whole_s, 2), "baseline": round(base, 2), "unit": "s",
         "ratio": round(whole_s / base, 2), "goal": ""},
        {"measurement": f"load {label}: peak RSS added vs weights (streamed)",
         "value": round(peak_ratio * weights / (1 << 30), 2),
         "baseline": round(weights / (1 << 30), 2), "unit": "GiB",
         "ratio": round(peak_ratio, 2), "goal": "<= 1.25x"},
        {"measurement": f"load {label}: peak RSS added vs weights (whole-file, before)",
         "value": round(whole_peak_ratio * weights / (1 << 30), 2),
         "baseline": round(weights / (1 << 30), 2), "unit": "GiB",
         "ratio": round(whole_peak_ratio, 2), "goal": ""},
        {"measurement": f"load {label}: dry run (model compute, apart)",
         "value": round(med(cold, "dry_run_s"), 2), "baseline": None, "unit": "s",
         "ratio": None, "goal": ""},
    ]  # fmt: skip
    print(json.dumps({"bench": "load", "rows": rows}))
    print(
        json.dumps(
            {
                "weights_gib": round(weights / (1 << 30), 3),
                "cold_ratio_vs_sha256sum": round(cold_s / base, 3),
                "warm_ratio_vs_sha256sum": round(warm_s / base, 3),
                "peak_rss_ratio": round(peak_ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
