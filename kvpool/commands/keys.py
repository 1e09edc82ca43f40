"""`kvpool keys PREFIX`: the caller's stored keys beginning with PREFIX, in byte order, page after page."""

import json


def add_parser(sub, add_target, connect) -> None:
    keys = sub.add_parser("keys", help="the stored keys beginning with PREFIX, one a line, in byte order")
    keys.add_argument("prefix", metavar="PREFIX", nargs="?", default="", help="\"\" or none: every key")
    add_target(keys)
    keys.add_argument("--limit", type=int, default=None, metavar="N", help="list the first N keys only")
    keys.add_argument("--json", action="store_true", help="one JSON list of the keys")
    keys.set_defaults(func=lambda args: cmd_keys(args, connect))


def cmd_keys(args, connect) -> int:
    """The stored keys beginning with PREFIX, in byte order, every page (or the first --limit keys)."""
    from ..protocol.keys import MAX_LIST_LIMIT

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, not {args.limit}")
    listed: list[str] = []
    left = args.limit
    with connect(args) as client:
        cursor = None
        while left is None or left > 0:
            keys, cursor = client.list_keys(args.prefix, min(MAX_LIST_LIMIT, left or MAX_LIST_LIMIT), cursor)
            if args.json:
                listed += keys
            elif keys:
                print("\n".join(keys), flush=True)
            if left is not None:
                left -= len(keys)
            if cursor is None:
                break
    if args.json:
        print(json.dumps(listed))
    return 0
