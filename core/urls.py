"""Service URLs: one database driver, and secrets kept out of everything that is shown."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def normalize_database_url(url: str) -> str:
    """Point any Postgres URL at the psycopg 3 driver; reject other databases."""
    scheme = urlsplit(url).scheme
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        return "postgresql+psycopg" + url[len(scheme) :]
    raise ValueError(f"database url must be postgresql://, got {redact(url)}")


def redact(url: str) -> str:
    """The URL with any password replaced, for logs and --json output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
