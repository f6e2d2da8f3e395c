"""Cold fetch-and-verify throughput of the artifact cache vs `sha256sum`, same files, one run.

The cache does more than sha256sum (it also copies every byte into the cache and fsyncs), so a
ratio near 1 means hashing while streaming costs no second pass. Usage:
    .venv/bin/python bench/bench_verify.py [--gib 1] [--files 4] [--rounds 3]
Prints one line per layout and a final summary line.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cache import ArtifactCache
from app.manifest import Architecture
from app.packing import pack_artifact

CHUNK = 64 << 20


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as fh:
        left = size
        while left:
            n = min(CHUNK, left)
            fh.write(os.urandom(n))
            left -= n


def time_sha256sum(files: list[Path]) -> float:
    started = time.perf_counter()
    subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def time_fetch(root: Path, uri: str, digest: str) -> float:
    cache_root = root / "cache"
    shutil.rmtree(cache_root, ignore_errors=True)
    cache = ArtifactCache(cache_root)
    started = time.perf_counter()
    cache.fetch_verified(uri, digest)
    elapsed = time.perf_counter() - started
    shutil.rmtree(cache_root, ignore_errors=True)
    return elapsed


def run_layout(root: Path, total: int, nfiles: int, rounds: int) -> tuple[float, float, float]:
    src = root / f"src-{nfiles}"
    src.mkdir()
    for i in range(nfiles):
        write_random(src / f"shard-{i:02d}.bin", total // nfiles)
    result = pack_artifact(
        src,
        root / f"art-{nfiles}",
        model="bench",
        artifact_id=f"bench-{nfiles}",
        feature_schema="none",
        architecture=Architecture(name="bench", version=1),
    )
    files = sorted(result.out_dir.glob("shard-*.bin"))
    # Warm the page cache for both sides alike, then alternate the two measurements.
    time_sha256sum(files)
    base, ours = [], []
    for _ in range(rounds):
        base.append(time_sha256sum(files))
        ours.append(time_fetch(root, result.manifest_uri, result.manifest_sha256))
    shutil.rmtree(src)
    shutil.rmtree(result.out_dir)
    gib = total / (1 << 30)
    return gib / statistics.median(base), gib / statistics.median(ours), gib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    total = int(args.gib * (1 << 30))
    ratios = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-verify-", dir="/var/tmp") as tmp:
        for nfiles in args.files:
            sums, fetch, gib = run_layout(Path(tmp), total, nfiles, args.rounds)
            ratios.append(fetch / sums)
            rows.append(
                {
                    "measurement": f"verify {gib:.0f} GiB in {nfiles} file(s) vs sha256sum",
                    "value": round(fetch, 3),
                    "baseline": round(sums, 3),
                    "unit": "GiB/s",
                    "ratio": round(fetch / sums, 2),
                    "goal": ">= 0.9x",
                }
            )
            print(
                f"verify {gib:.2f} GiB in {nfiles} file(s): sha256sum {sums:.2f} GiB/s, "
                f"cache fetch+verify {fetch:.2f} GiB/s, ratio {fetch / sums:.2f}x",
                flush=True,
            )
    print(f"verify throughput vs sha256sum: best layout {max(ratios):.2f}x (goal >= 0.9x)")
    print(json.dumps({"bench": "verify", "rows": rows}))


if __name__ == "__main__":
    main()
