"""`kvpool tenant`: an operator's tenants (kvpool/protocol/tenants.py), through the master's Tenants call.

create, set, rotate, delete, list and usage; each needs the cluster secret (--token-file, or
KVPOOL_TOKEN_FILE). A tenant's token is made here from the secret and the record's version, and written only
to --token-out (mode 0600), never to the terminal.
"""

import argparse
import json
import os

from ..protocol.units import format_size, parse_size

# Flags of the limits, as TenantLimits names them, and how each is read.
LIMIT_FLAGS = {"quota": parse_size, "quota_dram": parse_size, "quota_ssd": parse_size,
               "quota_objects": int, "reserve": parse_size}
_COLUMNS = ["TENANT", "VERSION", "QUOTA", "DRAM QUOTA", "SSD QUOTA", "OBJ QUOTA", "RESERVE", "OBJECTS", "DRAM",
            "SSD", "HITS", "MISSES", "EVICTED(QUOTA)", "EVICTED(PRESSURE)", "REFUSED"]


def add_parser(sub, add_target, secret_of, connect) -> None:
    tenant = sub.add_parser("tenant", help="an operator's tenants: create, set, rotate, delete, list, usage")
    actions = tenant.add_subparsers(dest="action", required=True)
    for action, help_text in (("create", "a new tenant, and its token in --token-out"),
                              ("set", "change a tenant's limits (those given)"),
                              ("rotate", "a new token (the old one stops at once, open connections too)"),
                              ("delete", "remove a tenant and free its objects on every node"),
                              ("list", "every tenant, its limits and what it holds"),
                              ("usage", "what a tenant (or every tenant) holds and did")):
        parser = actions.add_parser(action, help=help_text)
        parser.add_argument("name", metavar="NAME", nargs="?" if action in ("list", "usage") else None)
        add_target(parser)
        if action in ("create", "set"):
            for limit, kind in LIMIT_FLAGS.items():
                parser.add_argument("--" + limit.replace("_", "-"), type=_checked(kind), default=None,
                                    metavar="N" if kind is int else "SIZE")
        if action in ("create", "rotate"):
            parser.add_argument("--token-out", required=True, metavar="FILE",
                                help="where to write the tenant's token (created mode 0600)")
        if action in ("list", "usage"):
            parser.add_argument("--json", action="store_true", help="one JSON list")
        parser.set_defaults(func=lambda args: run(args, secret_of, connect))


def _checked(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
        return value
    return parse


def run(args, secret_of, connect) -> int:
    from ..security import auth

    secret = secret_of(args)
    if getattr(args, "token_out", None) and os.path.exists(args.token_out):
        raise ValueError(f"--token-out {args.token_out} exists: give a new file (a token is never overwritten "
                         "in place)")
    limits = {limit: getattr(args, limit) for limit in LIMIT_FLAGS if getattr(args, limit, None) is not None}
    with connect(args, token=secret) as client:
        tenants = client.tenants(args.action, args.name or "", **limits)
    if args.action in ("list", "usage"):
        if args.json:
            from google.protobuf.json_format import MessageToDict

            print(json.dumps([MessageToDict(t, preserving_proto_field_name=True,
                                            always_print_fields_with_no_presence=True) for t in tenants]))
        else:
            print(render_tenants(tenants))
        return 0
    [record] = tenants
    if args.action in ("create", "rotate"):
        auth.write_private(args.token_out, auth.tenant_token(secret, record.name, record.version))
        print(f"tenant {record.name}: token version {record.version} written to {args.token_out}", flush=True)
    else:
        print(f"tenant {record.name}: {args.action} done", flush=True)
    return 0


def _limit(value: int, size: bool = True) -> str:
    return (format_size(value) if size else str(value)) if value else "-"


def render_tenants(tenants) -> str:
    rows = [list(_COLUMNS)]
    for t in tenants:
        limits = t.limits
        rows.append([t.name, str(t.version), _limit(limits.quota), _limit(limits.quota_dram),
                     _limit(limits.quota_ssd), _limit(limits.quota_objects, size=False), _limit(limits.reserve),
                     str(t.objects), format_size(t.dram_bytes), format_size(t.ssd_bytes), str(t.hits),
                     str(t.misses), str(t.evicted_quota), str(t.evicted_pressure), str(t.refused)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
