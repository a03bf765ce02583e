"""Which requests a browser may make to `serve`: the server has no authentication, so a web page the
user opens must not be able to drive it. Two browser attacks reach a loopback server (the class of
Ollama's CVE-2024-28224): a page posting a "simple" request (text/plain or a form, no CORS
preflight) straight at 127.0.0.1, and DNS rebinding, where the page's own host name is made to
resolve to 127.0.0.1 so that its requests carry a foreign Host. So: only JSON bodies (a browser
must preflight those, and the preflight is refused), a Host naming this server, and no Origin but
this server's own or one the operator allowed (`--allow-origin`). Pure functions, no HTTP stack."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
JSON_TYPES = frozenset({"application/json"})
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class BrowserPolicy:
    """The address `serve` was asked to listen on (`--host`) and the origins allowed (`--allow-origin`)."""

    bind_host: str = "127.0.0.1"
    allowed_origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


def bracketed(host: str) -> str:
    """An IPv6 literal as a Host header writes it ("[::1]"); other names unchanged, lower case."""
    host = host.lower()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def split_host(value: str) -> tuple[str, int | None] | None:
    """("name", port or None) of a Host header value, or None when it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[: end + 1], value[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, colon, tail = value.partition(":")
        port_text = tail if colon else None
    if not name:
        return None
    if port_text is None:
        return name, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return name, int(port_text)


def is_this_server(name: str, port: int | None, policy: BrowserPolicy, local: tuple[str, int] | None) -> bool:
    """Whether a host name and port address this server: a loopback name, the --host it was given or
    the local address the connection arrived on, and (when a port is named) the port it listens on."""
    names = set(LOCAL_NAMES) | {bracketed(policy.bind_host)}
    if local is not None:
        names.add(bracketed(local[0]))
    return name in names and (port is None or local is None or port == local[1])


def check_origin_rules(origin: str) -> str | None:
    """The problem with an --allow-origin value, or None: "*" or scheme://host[:port], nothing more."""
    if origin == "*":
        return None
    parts = urlsplit(origin)
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path or parts.query or parts.fragment:
        return f"--allow-origin {origin!r} is not an origin (scheme://host[:port], no path)"
    return None


def origin_allowed(origin: str, policy: BrowserPolicy, local: tuple[str, int] | None) -> bool:
    """The server's own origin, or one --allow-origin names ("*": any)."""
    if "*" in policy.allowed_origins or origin in policy.allowed_origins:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return False  # "null" (a sandboxed page, a file), or anything odd
    try:
        port = parts.port or DEFAULT_PORTS[parts.scheme]
    except ValueError:
        return False
    return is_this_server(bracketed(parts.hostname), port, policy, local)


def refusal(
    method: str, headers: dict[str, str], policy: BrowserPolicy, local: tuple[str, int] | None
) -> Refusal | None:
    """Why a request is refused (403 foreign Host or Origin, 415 a body that is not JSON), or None."""
    host = headers.get("host")
    if host is not None:
        parsed = split_host(host)
        if parsed is None or not is_this_server(*parsed, policy, local):
            return Refusal(
                403,
                f"the Host header {host[:100]!r} does not name this server (a web page's request through DNS "
                "rebinding is refused); use http://127.0.0.1 or http://localhost with the server's port",
            )
    origin = headers.get("origin")
    if origin is not None and not origin_allowed(origin, policy, local):
        return Refusal(
            403,
            f"requests from the web page origin {origin[:100]!r} are refused (the server has no authentication); "
            "start it with --allow-origin ORIGIN to allow that page",
        )
    if method == "POST":
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type not in JSON_TYPES:
            return Refusal(
                415, f"the body's Content-Type {media_type[:100]!r} is not JSON; send it as application/json"
            )
    return None
