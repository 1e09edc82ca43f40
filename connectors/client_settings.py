"""Where the kvpool cluster is, read from an engine's connector options (every engine's config carries the same
keys: "master" or "etcd" (+ "cluster"), "transports", "token_file" (or "token", which then shows in the engine's
command line: prefer the file, or $KVPOOL_TOKEN_FILE), "tls_ca", "timeout")."""

from kvpool.security.auth import read_token
from kvpool.errors import InvalidArgumentError

# Seconds a connector's kvpool call (a lookup, a load, a save) may take: well below what recomputing a prompt's
# blocks costs. A load past it is reported failed, so the engine computes those blocks; a save past it is dropped
# (logged); a lookup past it finds nothing. "timeout" in the engine's connector options sets it.
CONNECTOR_TIMEOUT = 2.0


def client_settings(options: dict, where: str) -> dict:
    """Keyword arguments for kvpool.Client / AsyncClient; `where` names the engine setting, for the error."""
    master, etcd = options.get("master"), options.get("etcd")
    if (master is None) == (etcd is None):
        raise InvalidArgumentError(f'kvpool needs "master": "HOST:PORT" or "etcd": "HOST:PORT" (one of them) {where}')
    settings = {name: str(options[name]) for name in ("cluster", "transports", "token", "tls_ca") if options.get(name)}
    try:
        settings["timeout"] = float(options.get("timeout", CONNECTOR_TIMEOUT))
    except (TypeError, ValueError):
        settings["timeout"] = 0.0
    if not settings["timeout"] > 0:
        raise InvalidArgumentError(f'"timeout" must be a positive number of seconds, got {options["timeout"]!r} '
                                   f'{where}')
    if options.get("token_file"):
        try:
            settings["token"] = read_token(str(options["token_file"]), env={})
        except ValueError as exc:
            raise InvalidArgumentError(f"{exc} ({where})") from None
    if master is not None:
        return {"address": str(master), **settings}
    return {"etcd": str(etcd), **settings}
