"""Secrets never shown, control characters never reach a terminal raw."""

from __future__ import annotations

import pytest

from app.safe_text import redact_in, redact_uri, secrets_of, terminal_safe


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("postgresql://user:secret@db:5432/x", "postgresql://user:***@db:5432/x"),
        ("postgresql://:secret@db/x", "postgresql://:***@db/x"),  # empty user
        ("postgresql://u:pa/ss@db/x", "postgresql://u:***@db/x"),  # '/' in the password
        ("postgresql://u:p@ss@db/x", "postgresql://u:***@db/x"),  # '@' in the password
        ("postgresql://db/x?password=secret", "postgresql://db/x?password=***"),
        ("host=db password=secret dbname=x", "host=db password=*** dbname=x"),
        ("host=db password='se cret' dbname=x", "host=db password=*** dbname=x"),
        (
            "https://b.s3.amazonaws.com/m.json?X-Amz-Signature=abc&X-Amz-Credential=AKIA",
            "https://b.s3.amazonaws.com/m.json?X-Amz-Signature=***&X-Amz-Credential=***",
        ),
        ("https://TOKEN123@h/x", "https://***@h/x"),  # a lone token is a credential
        ("s3://bucket/a/b@c/manifest.json", "s3://bucket/a/b@c/manifest.json"),  # a key's '@'
        ("file:///tmp/x/manifest.json", "file:///tmp/x/manifest.json"),
    ],
)
def test_redact_uri_masks_every_credential_form(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown


def test_redact_in_masks_a_driver_echoing_part_of_the_password() -> None:
    uri = "postgresql://u:pa/ss@db/x"
    message = 'missing "=" after "pa/ss@db/x" in connection info string (pa/ss)'
    shown = redact_in(message, uri)
    assert "pa/ss" not in shown
    assert secrets_of(uri) == ["pa/ss"]


def test_redact_in_leaves_harmless_query_values_readable() -> None:
    uri = "postgresql://db/x?sslmode=require&password=hunter22"
    shown = redact_in(f"connecting to {uri} failed: sslmode require refused", uri)
    assert "hunter22" not in shown
    assert "sslmode require refused" in shown


def test_terminal_safe_escapes_controls_bidi_and_zero_width() -> None:
    shown = terminal_safe("a\x1b[31mred\u202eevil\u200bx\ny\x9b")
    assert shown == "a\\x1b[31mred\\u202eevil\\u200bx\\x0ay\\x9b"
    assert terminal_safe("ranker-v42/weights.pt é") == "ranker-v42/weights.pt é"


@pytest.mark.parametrize(
    ("uri", "echoed"),
    [
        # What psycopg prints for URLs it cannot parse: a piece of the password, quoted.
        ("postgresql://:secretpw/x@127.0.0.1:5432/db", 'invalid integer value "secretpw"'),
        ("postgresql://u:hunter@secret2@127.0.0.1:1/x", "failed to resolve host 'secret2@1"),
    ],
)
def test_redact_in_masks_the_pieces_of_a_password_a_driver_quotes(uri: str, echoed: str) -> None:
    shown = redact_in(f"{echoed} for connection option", uri)
    assert "secretpw" not in shown and "secret2" not in shown and "hunter" not in shown, shown
