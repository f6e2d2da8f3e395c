"""The signature files kept in a cache entry beside its manifest (the project's
``manifest.json.sig``, an OpenSSF ``model.sig``): which names they have, reading them from an
entry or a source, storing a source's newer ones, and checking a hit against the trust policy
(app.trust)."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from app.artifact_store import ArtifactSource
from app.cache.files import read_cached_file, write_synced
from app.contracts import FetchConfig, SignatureTrust
from app.errors import ArtifactRejected
from app.manifest import Manifest
from app.trust import TrustPolicy, signature_limits


class EntrySignatures:
    """The signatures of entries of one cache, under its trust policy (None: none asked for;
    the files are kept all the same, for consumers that trust them)."""

    def __init__(self, trust: TrustPolicy | None, fetch: FetchConfig) -> None:
        self.trust = trust
        self.fetch = fetch
        self._limits = signature_limits(
            trust.signature_file if trust else SignatureTrust().signature_file
        )

    def names(self, manifest: Manifest) -> dict[str, int]:
        """The signature files this cache reads beside a manifest, with their size limits: a
        name the manifest lists is one of its files, not a signature (a policy refuses such an
        artifact; without one it is served like any other)."""
        listed = {item.path for item in manifest.files}
        return {n: limit for n, limit in self._limits.items() if n not in listed}

    def stored(self, entry: Path, manifest: Manifest) -> dict[str, bytes | None]:
        stored: dict[str, bytes | None] = {}
        for name, limit in self.names(manifest).items():
            try:
                stored[name] = read_cached_file(entry / name, f"cached signature {name}", limit)
            except FileNotFoundError:
                stored[name] = None
        return stored

    def read(self, source: ArtifactSource, manifest: Manifest) -> dict[str, bytes | None]:
        return {
            name: source.read_small(name, limit=limit)
            for name, limit in self.names(manifest).items()
        }

    def keep(self, entry: Path, signatures: dict[str, bytes | None]) -> None:
        """Store the source's signatures in a published entry (each file replaced in one
        rename), so later hits check them without reading the source. Best effort: a hit
        that cannot store them reads the source again next time."""
        for name, data in signatures.items():
            if data is None:
                continue
            tmp = entry / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            try:
                write_synced(tmp, data)
                tmp.chmod(0o444)
                os.replace(tmp, entry / name)
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def check_hit(
        self,
        entry: Path,
        manifest: Manifest,
        manifest_bytes: bytes,
        stored: dict[str, bytes | None],
        manifest_uri: str | None,
    ) -> str:
        """The mode of the trusted signature over a hit: one stored in the entry, else one the
        source holds now (the manifest bytes are pinned by digest; a signature added or renewed
        at the source after the entry was published, e.g. on key rotation, is as good).
        ArtifactRejected ``signature`` when neither verifies."""
        assert self.trust is not None
        try:
            return self.trust.verify(manifest_bytes, manifest, stored)
        except ArtifactRejected as exc:
            stored_failure = ArtifactRejected(
                "signature", f"cached copy: {exc.detail}", artifact_id=manifest.artifact_id
            )
        if manifest_uri is None:
            raise stored_failure
        current = self.read(ArtifactSource(manifest_uri, self.fetch), manifest)
        if current == stored:
            raise stored_failure
        try:
            mode = self.trust.verify(manifest_bytes, manifest, current)
        except ArtifactRejected as exc:
            raise ArtifactRejected(
                "signature",
                f"{stored_failure.detail}; at the source: {exc.detail}",
                artifact_id=manifest.artifact_id,
            ) from None
        self.keep(entry, current)
        return mode
