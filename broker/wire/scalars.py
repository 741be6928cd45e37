"""The readable scalar fields of a wire entry (`schema`, ids, versions, the MAC) and the byte cap
of a sample's text: each checked against `WireLimits` before anything of it is used, every
failure a `WireError` with a reason (broker/wire/schema.py decodes the rest)."""

from __future__ import annotations

from rollflash.broker.wire.wire import WireError, WireLimits


def check_schema(fields: dict[bytes, bytes], version: int) -> None:
    schema = fields.get(b"schema")
    if schema != str(version).encode():
        raise WireError(f"schema {schema!r} is not the supported {version}", "schema")


def text_field(fields: dict[bytes, bytes], key: str, what: str, limits: WireLimits) -> str:
    raw = fields.get(key.encode())
    if not isinstance(raw, bytes) or not 0 < len(raw) <= limits.max_id_bytes:
        raise WireError(
            f"{what}: bad scalar field {key} (missing or over {limits.max_id_bytes} bytes)",
            "bad_type",
        )
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise WireError(f"{what}: bad scalar field {key} (not UTF-8)", "bad_type") from None


def mac_field(fields: dict[bytes, bytes], what: str, limits: WireLimits) -> str:
    """The MAC, "" when missing: whether it is right is the learner's check
    (broker/channels/provenance.py), not the decoder's."""
    return text_field(fields, "mac", what, limits) if fields.get(b"mac") else ""


def int_field(fields: dict[bytes, bytes], key: str, what: str, low: int, high: int) -> int:
    raw = fields.get(key.encode())
    try:
        value = int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise WireError(f"{what}: bad scalar field {key} ({raw!r:.40})", "bad_type") from None
    if not low <= value <= high:
        raise WireError(f"{what}.{key}: {value} outside [{low}, {high}]", "out_of_range")
    return value


def check_text(value: str, what: str, limits: WireLimits) -> None:
    """At most `max_text_bytes` of UTF-8 (characters first: a character is 1 to 4 bytes)."""
    cap = limits.max_text_bytes
    if len(value) > cap or (len(value) * 4 > cap and len(value.encode()) > cap):
        raise WireError(f"{what}: over {cap} bytes", "too_large")
