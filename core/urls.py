"""Service URLs: one database driver, and secrets kept out of everything that is shown."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

HIDDEN = "***"
# Query parameters that carry a secret in libpq, psycopg and redis-py URLs; any name holding
# "token" or "secret" too. (``sslkey``, ``sslcert`` and the like are paths: fine to show.)
_SECRET_PARAMS = frozenset({"password", "passwd", "pwd", "sslpassword"})
_SECRET_WORDS = re.compile("token|secret", re.IGNORECASE)


def normalize_database_url(url: str) -> str:
    """Point any Postgres URL at the psycopg 3 driver; reject other databases."""
    scheme = urlsplit(url).scheme
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        return "postgresql+psycopg" + url[len(scheme) :]
    raise ValueError(f"database url must be postgresql://, got {redact(url)}")


def libpq_url(url: str) -> str:
    """The same Postgres URL as libpq (psycopg.connect) takes it: ``postgresql://``."""
    return "postgresql" + normalize_database_url(url)[len("postgresql+psycopg") :]


def redact(url: str) -> str:
    """The URL with every secret replaced: the userinfo password and secret query values.

    The one function for any URL the project prints, logs or writes into a document.
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL one can take apart (an invalid port, say)
        return HIDDEN
    netloc = parts.netloc
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{HIDDEN}@{host}"
    query = "&".join(_redacted_param(name, value) for name, value in _params(parts.query))
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def scrub(text: str, *urls: str) -> str:
    """``text`` (a driver's error message, say) with every secret of ``urls`` hidden."""
    for url in urls:
        for secret in sorted(_secrets_of(url), key=len, reverse=True):
            text = text.replace(secret, HIDDEN)
    return text


def password_in_userinfo(url: str) -> str:
    """A Redis URL with a ``password`` query parameter moved into the userinfo.

    redis-py reads either; kombu (so Celery and Flower) refuses the query form outright.
    """
    parts = urlsplit(url)
    params = _params(parts.query)
    password = next((value for name, value in params if name == "password"), None)
    if password is None or parts.password is not None:
        return url
    user = unquote(parts.username or "")
    rest = "&".join(
        f"{quote(n, safe='')}={quote(v, safe='/:,')}" for n, v in params if n != "password"
    )
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc, query=rest))


def _secrets_of(url: str) -> set[str]:
    """The secret values inside ``url``, as written and decoded."""
    try:
        parts = urlsplit(url)
        found = [parts.password] if parts.password else []
    except ValueError:
        return set()
    found += [value for name, value in _params(parts.query) if value and _is_secret(name)]
    forms = (lambda s: s, unquote, lambda s: quote(s, safe=""))
    return {form(secret) for secret in found for form in forms}


def _params(query: str) -> list[tuple[str, str]]:
    return parse_qsl(query, keep_blank_values=True)


def _is_secret(name: str) -> bool:
    return name.lower() in _SECRET_PARAMS or _SECRET_WORDS.search(name) is not None


def _redacted_param(name: str, value: str) -> str:
    shown = HIDDEN if _is_secret(name) and value else quote(value, safe="/:,")
    return f"{quote(name, safe='')}={shown}"
