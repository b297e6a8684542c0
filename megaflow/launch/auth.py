"""Ray token authentication for multi-node clusters (Ray's ``RAY_AUTH_MODE=token``).

Ray 2.60 authenticates every RPC with a shared token when ``RAY_AUTH_MODE=token``; the
token comes from ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` or
``~/.ray/auth_token``. A driver that connects with an explicit address
(``ray.init(address="10.0.0.1:6379")``) does *not* switch token mode on by itself, so
it fails against a token-protected cluster unless ``RAY_AUTH_MODE=token`` is set:
:func:`enable_token_auth` does that whenever a token is available.

megaflow's node launcher requires a token unless the user opts out explicitly with
``RAY_AUTH_MODE=disabled``: a Ray cluster without one runs arbitrary code for anyone who
can reach its ports. Tokens are never printed.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

MODE, TOKEN, TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def token_source(env: MutableMapping[str, str] | None = None) -> str | None:
    """Where Ray would read the token from (``"$RAY_AUTH_TOKEN"``, a file path), or None."""
    env = os.environ if env is None else env
    if env.get(TOKEN, "").strip():
        return f"${TOKEN}"
    path = env.get(TOKEN_PATH)
    if path:
        return path if Path(path).expanduser().is_file() else None
    default = Path(env.get("HOME", str(Path.home()))) / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def enable_token_auth(env: MutableMapping[str, str] | None = None, *, required: bool = False) -> bool:
    """Switch Ray to token mode in ``env`` (default ``os.environ``) when a token exists.

    Respects an explicit ``RAY_AUTH_MODE`` (``disabled`` is the user's opt-out).

    Args:
        required: raise when token mode is on (or unset) but no token can be found.

    Returns:
        Whether token authentication is on.

    Raises:
        ValueError: ``required`` and no token (says how to create and share one), or
            ``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN_PATH`` naming a missing file.
    """
    env = os.environ if env is None else env
    mode = env.get(MODE, "").strip().lower()
    if mode == "disabled":
        return False
    source = token_source(env)
    if source is None:
        if env.get(TOKEN_PATH):
            raise ValueError(f"{TOKEN_PATH}={env[TOKEN_PATH]} does not exist")
        if required or mode == "token":
            raise ValueError(
                "no Ray authentication token: create one readable only by you on a path every node sees "
                "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > ~/.ray/auth_token; "
                f"chmod 600 ~/.ray/auth_token`, or set {TOKEN_PATH}), or opt out with {MODE}=disabled")
        return False
    env[MODE] = "token"
    return True


__all__ = ["token_source", "enable_token_auth"]
