"""Request bodies read apart from admitted work, under bounds of their own.

A body arrives at the client's pace. Read inside an admission slot, four stalled uploads
held every slot of a router with ``max_in_flight: 4`` and every other request got a 503; at
a production ``max_in_flight`` of 2048 the bodies held could reach 16 GiB per router
replica. And timed from before the read, a slow upload counted as the cohort's latency, the
very number the canary is judged on. So the router reads a body first, with ``BodyReads``:

- a deadline for the whole body (``body_timeout_s``): 408 when it passes;
- at most ``max_body_reads`` bodies read at once and ``max_body_read_bytes`` held by them
  together (a declared ``Content-Length`` is reserved before a byte is read): 503 beyond;

and only then admits the request against ``max_in_flight`` and starts its judged latency.
The bounds are per router replica (one event loop: no lock needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator

from app.api import MAX_BODY_BYTES, read_body
from app.errors import BodyReadsFull, BodyReadTimeout


class BodyReads:
    """The bodies one router replica is reading now, and the bytes they hold."""

    def __init__(self) -> None:
        self.reading = 0
        self.held_bytes = 0

    async def read(
        self,
        content_length: str | None,
        chunks: AsyncIterable[bytes],
        *,
        timeout_s: float,
        max_reads: int,
        max_bytes: int,
        limit: int = MAX_BODY_BYTES,
    ) -> bytes:
        """The body (``app.api.read_body``: at most ``limit`` bytes), read under the deadline
        and the shared bounds; RequestInvalid subclasses name what was passed."""
        if self.reading >= max_reads:
            raise BodyReadsFull(
                f"{self.reading} request bodies are being read already (router max_body_reads)",
                "max_body_reads",
            )
        declared = _declared(content_length, limit)
        if self.held_bytes + declared > max_bytes:
            raise BodyReadsFull(
                f"the bodies being read hold {self.held_bytes} bytes; {declared} more would pass "
                f"{max_bytes} (router max_body_read_bytes)",
                "max_body_read_bytes",
            )
        self.reading += 1
        self.held_bytes += declared
        held = declared  # what this read has counted in ``held_bytes``

        async def counted() -> AsyncIterator[bytes]:
            nonlocal held
            received = 0
            async for chunk in chunks:
                received += len(chunk)
                more = max(0, received - held)  # beyond what the declared length reserved
                if more and self.held_bytes + more > max_bytes:
                    raise BodyReadsFull(
                        f"the bodies being read would hold more than {max_bytes} bytes "
                        "(router max_body_read_bytes)",
                        "max_body_read_bytes",
                    )
                self.held_bytes += more
                held += more
                yield chunk

        try:
            return await asyncio.wait_for(read_body(content_length, counted(), limit), timeout_s)
        except TimeoutError:
            raise BodyReadTimeout(timeout_s) from None
        finally:
            self.reading -= 1
            self.held_bytes -= held


def _declared(content_length: str | None, limit: int) -> int:
    """What a ``Content-Length`` reserves: its value when it is one within ``limit`` (read_body
    refuses the others, with their own answers), else nothing."""
    value = (content_length or "").strip()
    return int(value) if value.isdigit() and int(value) <= limit else 0
