"""The OpenSSF signature check of a cache hit vs the model-signing library's own check, one run.

A replica checks the signature of every cache hit. The library's `verify` hashes the whole
model directory to compare it with the signed digests; this service hands it the digests the
pinned manifest holds instead (the bytes were hashed when the entry was fetched, and loaders
re-hash what they read). Both verify the same bundle with the same key; the baseline is the
library's check, `sha256sum` of the same files is printed for scale. Usage:
    .venv/bin/python bench/bench_signature.py [--gib 1] [--rounds 3] [--quick]
Prints one line per measurement and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cache import ArtifactCache
from app.contracts import SignatureTrust
from app.manifest import Architecture
from app.packing import pack_artifact
from app.signing import generate_keypair
from bench.bench_verify import write_random


def timed(work: object, rounds: int) -> float:
    assert callable(work)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="0.25 GiB, one round")
    args = parser.parse_args()
    gib, rounds = (0.25, 1) if args.quick else (args.gib, args.rounds)
    total = int(gib * (1 << 30))
    import model_signing.verifying

    with tempfile.TemporaryDirectory(prefix="bench-signature-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        generate_keypair(root / "ec.pem", root / "ec.pub", kind="ec-p256")
        src = root / "src"
        src.mkdir()
        for i in range(4):
            write_random(src / f"shard-{i:02d}.bin", total // 4)
        art = pack_artifact(
            src, root / "art", model="bench", artifact_id="bench-signed",
            feature_schema="none", architecture=Architecture(name="bench", version=1),
            sign_key=root / "ec.pem",
        )  # fmt: skip
        files = sorted(art.out_dir.glob("shard-*.bin"))
        trusting = ArtifactCache(root / "cache", trust=SignatureTrust(keys=[str(root / "ec.pub")]))
        entry = trusting.fetch_verified(art.manifest_uri, art.manifest_sha256)
        assert entry.signature == "openssf-key"
        library = model_signing.verifying.Config().use_elliptic_key_verifier(
            public_key=root / "ec.pub"
        )
        subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)

        def hit() -> None:
            got = trusting.fetch_verified(art.manifest_uri, art.manifest_sha256)
            assert got.cached and got.signature == "openssf-key"

        ours = timed(hit, rounds)
        theirs = timed(lambda: library.verify(art.out_dir, art.out_dir / "model.sig"), rounds)
        sums = timed(
            lambda: subprocess.run(
                ["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL
            ),
            rounds,
        )
    print(
        f"signature check of a {gib:g} GiB cache hit: {ours * 1000:.1f} ms here, "
        f"{theirs * 1000:.1f} ms by model_signing's verify (re-hash), "
        f"sha256sum {sums * 1000:.1f} ms",
        flush=True,
    )
    rows = [
        {
            "measurement": f"OpenSSF check of a {gib:g} GiB cache hit vs model_signing verify",
            "value": round(ours * 1000, 2),
            "baseline": round(theirs * 1000, 2),
            "unit": "ms",
            "ratio": round(ours / theirs, 4),
            "goal": "<< 1x (no second read)",
        }
    ]
    print(json.dumps({"bench": "signature", "rows": rows}))


if __name__ == "__main__":
    main()
