"""Names this release changed, still accepted for one release (0.2 drops them).

The fixture presets and the bundled plan example below were named after the Kimi K3 we expected before it
shipped (Kimi-K2.5 over DeepSeek-V3.2 or DeepSeek-V4 text); the real Kimi K3 is another architecture, so
each is now named after the models it mirrors and `k3` names are kept for the real one. An old name
resolves to its new one; whoever took it from a user says so (`note`)."""

from __future__ import annotations

PRESETS = {
    "tiny-k3": "tiny-k25-dsv32",
    "tiny-k3-fp8": "tiny-k25-dsv32-fp8",
    "tiny-k3-int4": "tiny-k25-dsv32-int4",
    "tiny-k3-4l": "tiny-k25-dsv32-4l",
    "tiny-k3-trained": "tiny-k25-dsv32-trained",
    "tiny-k3-trained-wide": "tiny-k25-dsv32-trained-wide",
    "small-k3": "small-k25-dsv32",
    "tiny-k3v4": "tiny-k25-dsv4",
    "tiny-k3v4-trained": "tiny-k25-dsv4-trained",
}
EXAMPLES = {"kimi-k3-3t": "k25-dsv32-3t"}  # bundled plan configs (manifests/examples/)


def current(table: dict[str, str], name: str) -> str:
    """`name`, or the name it was renamed to."""
    return table.get(name, name)


def note(table: dict[str, str], name: str, what: str) -> str | None:
    """One line telling a user who typed an old name what it is called now (None for a current name)."""
    if name not in table:
        return None
    return f"note: {what} {name!r} is now called {table[name]!r}; the old name goes in the next release"
