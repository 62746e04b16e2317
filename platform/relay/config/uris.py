"""Tracking URIs and their credentials: a URI that carries a secret is refused (the variables
that should hold it are named), and any URI shown is redacted."""

from __future__ import annotations

TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql")


# A query parameter whose name (or, for e.g. mssql's `odbc_connect=...;PWD=...`, whose value's
# own `name=`) holds one of these words carries a credential.
_SECRET_WORDS = ("pass", "pwd", "secret", "token", "apikey", "api_key", "access_key")


_CREDENTIALS_HELP = {  # where each kind of tracking URI's credentials go instead
    "http": "in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), "
    "environment variables MLflow reads",
    "postgresql": "in PGPASSWORD or ~/.pgpass, which the driver reads",
    "mysql": "in an option file the driver reads (?read_default_file=/path/my.cnf)",
    "mssql": "in a DSN or a trusted connection",
    "sql": "where the database driver reads them (its environment or files)",
}


def _secret_query(query: str) -> list[str]:
    from urllib.parse import parse_qsl

    def secret(text: str) -> bool:
        return any(word in text.lower() for word in _SECRET_WORDS)

    return [
        key
        for key, value in parse_qsl(query, keep_blank_values=True)
        if secret(key) or any(secret(part.partition("=")[0]) for part in value.split(";"))
    ]


def uri_credentials(uri: str) -> str | None:
    """What in a tracking URI is a credential (None: nothing). An HTTP URI may carry none: an
    `@` anywhere is taken for userinfo (requests sends it as basic auth); a database URI may
    name its user but not the password, as SQLAlchemy (MLflow's parser) reads it."""
    from urllib.parse import urlsplit

    scheme, _, rest = uri.partition("://")
    if scheme in ("http", "https") and "@" in rest:
        return "userinfo (user:password@)"
    if scheme not in ("http", "https") and not scheme.startswith("sqlite"):
        try:
            from sqlalchemy.engine import make_url

            password = make_url(uri).password
        except Exception:  # no SQLAlchemy, or not its form: any `user:...@` counts
            password = ":" in rest.rpartition("@")[0]
        if password:
            return "a password (user:password@)"
    named = _secret_query(urlsplit(uri).query)
    return f"the query parameter {named[0]!r}" if named else None


def redacted_uri(uri: str) -> str:
    """A tracking URI fit to print or record: what may be userinfo (all up to the last `@`)
    and the values of secret query parameters as `***`."""
    from urllib.parse import parse_qsl, urlencode

    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest and not scheme.startswith("sqlite"):
        uri = f"{scheme}://***@{rest.rpartition('@')[2]}"
    base, mark, query = uri.partition("?")
    query, hash_, fragment = query.partition("#")
    secret = set(_secret_query(query))
    if secret:
        pairs = [(k, "***" if k in secret else v) for k, v in parse_qsl(query, True)]
        uri = f"{base}{mark}{urlencode(pairs, safe='*/')}{hash_}{fragment}"
    return uri
