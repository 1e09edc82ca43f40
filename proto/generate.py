"""Regenerate kvpool_pb2*.py from kvpool.proto.

protoc names imports after the path it was given, so the .proto is staged at
kvpool/proto/ in a scratch tree: the generated stub then imports
`kvpool.proto.kvpool_pb2` and works from the installed package.
`python proto/generate.py --check` exits 1 when the committed files are stale.
"""

import argparse
import difflib
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
OUTPUTS = ("kvpool_pb2.py", "kvpool_pb2.pyi", "kvpool_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        staged = Path(scratch) / "kvpool" / "proto"
        staged.mkdir(parents=True)
        shutil.copy(HERE / "kvpool.proto", staged / "kvpool.proto")
        gen = Path(scratch) / "out"
        gen.mkdir()
        rc = protoc.main([
            "protoc", f"-I{scratch}", f"--python_out={gen}", f"--pyi_out={gen}",
            f"--grpc_python_out={gen}", "kvpool/proto/kvpool.proto",
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed with {rc}")
        for name in OUTPUTS:
            shutil.copy(gen / "kvpool" / "proto" / name, out_dir / name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="fail if committed code differs")
    args = parser.parse_args()
    if not args.check:
        generate(HERE)
        return 0
    with tempfile.TemporaryDirectory() as fresh:
        generate(Path(fresh))
        stale = []
        for name in OUTPUTS:
            want = (Path(fresh) / name).read_text().splitlines()
            have = (HERE / name).read_text().splitlines() if (HERE / name).exists() else []
            if want != have:
                stale.append(name)
                sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(have, want, name, name, lineterm=""))
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run python proto/generate.py", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
