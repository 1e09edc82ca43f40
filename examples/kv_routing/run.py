"""KV-aware routing across two vLLM engines sharing kvpool, on conversations from Mooncake's production trace.

    python3 examples/kv_routing/run.py [--requests 240] [--master HOST:PORT] [--json-only]

Builds vLLM's CPU venv on first use (examples/engine_venvs.py), makes the small random-weight Llama of the
vLLM examples, starts a local kvpool cluster (unless --master names one), and serves one workload four ways on
two vLLM engines (one CPU core each), each engine publishing its KV events:
  no_kvpool         round-robin; each engine reuses only its own prefix cache (the usual deployment)
  kv_aware_local    the router, following only the engines' own caches (no kvpool)
  round_robin       round-robin; engines load from kvpool whatever any engine computed before
  kv_aware          kvpool, and the router sends each request where most of its prefix is: an engine's own cache
                    first, then kvpool (kvpool.connectors.RoutingService, as `kvpool router` runs it)

The workload: whole conversations of ../shared/traces/conversation_trace.jsonl (a request whose leading hash ids
extend an earlier request's is that conversation's next turn), the earliest ones, served in arrival order; each trace block (512
tokens there) becomes one 128-token vLLM block whose tokens derive from its hash id, so equal ids are equal
token prefixes; a conversation's turn is sent only after its previous turn answered (and a short pause, the
user reading it). Each engine's own cache holds --local-blocks blocks (64: fewer than the workload needs, as
a GPU's memory holds less than a day of conversations). Between policies every cache is emptied (the engines' and kvpool's).

Prints, last, one JSON line: per policy computed_tokens (prompt tokens the engines computed), loaded_tokens
(from kvpool), local_hit_tokens, ttft_p50_ms, ttft_p90_ms, identical_tokens (every request's tokens equal the
no_kvpool run's), requests per engine; and kv_aware's computed tokens over round_robin's and no_kvpool's.
"""

import argparse
import json
import os
import queue
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client as Pipe, Listener
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from vllm_parts import make_model, start_cluster  # noqa: E402

TRACE = HERE.parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
BLOCK = 128            # the vLLM CPU engine's block size: one trace block becomes one of these
MAX_BLOCKS = 14        # conversations whose turns all fit (the model takes 2048 tokens)
TAIL = 8               # each request's own last tokens (its new message)
NEW_TOKENS = 8
LOCAL_BLOCKS = 64      # each engine's own KV cache, in blocks (default)
THINK = 0.3            # seconds between an answer and the conversation's next turn
ENGINES = ("engine-a", "engine-b")
POLICIES = (("no_kvpool", False, "round_robin"), ("kv_aware_local", False, "kv_aware"),
            ("round_robin", True, "round_robin"), ("kv_aware", True, "kv_aware"))


def workload(path: Path, requests: int) -> list[dict]:
    """Whole conversations of two turns or more, the earliest first, until there are `requests` turns; served in
    arrival order (the last conversation may lose its last turns to the count)."""
    rows = [json.loads(line) for line in path.open()]
    roots: dict[tuple, int] = {}
    conversation = []
    for i, row in enumerate(rows):
        ids = tuple(row["hash_ids"])
        owner = next((roots[ids[:k]] for k in range(len(ids), 1, -1) if ids[:k] in roots), i)
        conversation.append(owner)
        for k in range(2, len(ids) + 1):
            roots.setdefault(ids[:k], owner)
    turns: dict[int, list[int]] = {}
    for i, owner in enumerate(conversation):
        turns.setdefault(owner, []).append(i)
    kept = {owner for owner, members in turns.items()
            if len(members) >= 2 and all(len(rows[i]["hash_ids"]) <= MAX_BLOCKS for i in members)}
    chosen: list[int] = []
    for owner in sorted(kept):
        if len(chosen) >= requests:
            break
        chosen += turns[owner]
    chosen = sorted(chosen)[:requests]
    out = []
    for n, i in enumerate(chosen):
        tokens = []
        for block in rows[i]["hash_ids"]:
            rng = random.Random(block)
            tokens += [rng.randrange(1, 1000) for _ in range(BLOCK)]
        rng = random.Random(10**9 + i)
        tokens += [rng.randrange(1, 1000) for _ in range(TAIL)]
        out.append({"n": n, "conversation": conversation[i], "tokens": tokens})
    return out


# ---------------------------------------------------------------- one engine, in its own process (vLLM venv)

def run_engine(name: str, model: str, events_port: int, kvpool_master: str | None, control: str,
               key: bytes, local_blocks: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if kvpool_master:
        transfer = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connectors.vllm",
                                    kv_role="kv_both", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"master": kvpool_master, "model_id": "kv-routing"})
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048, enforce_eager=True,
              enable_prefix_caching=True, num_gpu_blocks_override=local_blocks, disable_log_stats=False, seed=0,
              kv_transfer_config=transfer,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=f"tcp://*:{events_port}"))  # "*": the engine binds it
    greedy = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=NEW_TOKENS)
    pipe = Pipe(control, authkey=key)
    pipe.send({"engine": name})
    while True:
        order = pipe.recv()
        if order["op"] == "exit":
            return
        if order["op"] == "reset":
            llm.reset_prefix_cache()
            order = {"op": "generate", "tokens": [1] * (BLOCK // 2)}  # a step, so the reset is published
        [out] = llm.generate([TokensPrompt(prompt_token_ids=order["tokens"])], greedy, use_tqdm=False)
        pipe.send({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                   "ttft_ms": out.metrics.first_token_latency * 1e3,
                   "kvpool": (out.kv_transfer_params or {}).get("kvpool", {})})


# ---------------------------------------------------------------- the driver (vLLM venv)

class Engine:
    """A started engine process and the pipe to it; serve() runs one request (one at a time)."""

    def __init__(self, name: str, process: subprocess.Popen, events: str):
        self.name, self.process, self.events = name, process, events
        self.pipe = None

    def serve(self, order: dict) -> dict:
        self.pipe.send(order)
        return self.pipe.recv()


def start_engines(python: str, model: Path, master: str | None, work: Path, quiet: bool,
                  local_blocks: int) -> dict[str, Engine]:
    from kvpool.net.netutil import free_port

    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    control = "%s:%d" % listener.address
    engines = {}
    for core, name in enumerate(ENGINES):
        port = free_port()
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core % os.cpu_count()), KVPOOL_ROUTING_KEY=key.hex())
        log = open(work / f"{name}-{'kvpool' if master else 'local'}.log", "w")
        process = subprocess.Popen([python, __file__, "--engine", name, "--model", str(model), "--events-port",
                                    str(port), "--control", control, "--local-blocks", str(local_blocks)]
                                   + (["--master", master] if master else []),
                                   stdout=log, stderr=subprocess.STDOUT if quiet else None, env=env)
        engines[name] = Engine(name, process, f"tcp://127.0.0.1:{port}")
    for _ in ENGINES:
        pipe = listener.accept()
        engines[pipe.recv()["engine"]].pipe = pipe
    listener.close()
    return engines


def stop_engines(engines: dict[str, Engine]) -> None:
    for engine in engines.values():
        if engine.pipe is not None:
            engine.pipe.send({"op": "exit"})
    for engine in engines.values():
        try:
            engine.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            engine.process.kill()


def serve_workload(engines: dict[str, Engine], requests: list[dict], router) -> list[dict]:
    """Send each request, in order, once its conversation's previous turn answered THINK seconds ago; each engine
    serves its queue one request at a time, both engines at once."""
    results: list[dict | None] = [None] * len(requests)
    answered: dict[int, float] = {}  # conversation -> when its last turn answered (absent: one is running)
    done = threading.Condition()
    queues = {name: queue.Queue() for name in engines}

    def work(engine: Engine):
        while (request := queues[engine.name].get()) is not None:
            out = engine.serve({"op": "generate", "tokens": request["tokens"]})
            out.update(engine=engine.name, prompt_tokens=len(request["tokens"]))
            router.finished(engine.name)
            with done:
                results[request["n"]] = out
                answered[request["conversation"]] = time.monotonic()
                done.notify_all()

    workers = [threading.Thread(target=work, args=(engine,)) for engine in engines.values()]
    for worker in workers:
        worker.start()
    started: set[int] = set()
    for request in requests:
        conversation = request["conversation"]
        with done:
            if conversation in started:
                done.wait_for(lambda: conversation in answered, timeout=600)
                wait = answered[conversation] + THINK - time.monotonic()
                if wait > 0:
                    done.wait(wait)  # the user reading the answer (nothing to notify: a plain pause)
            answered.pop(conversation, None)
            started.add(conversation)
        name, _ = router.choose(request["tokens"])
        queues[name].put(request)
    for name in queues:
        queues[name].put(None)
    for worker in workers:
        worker.join()
    return results


def reset(engines: dict[str, Engine], master: str | None, namespace: str | None) -> None:
    """Empty every cache: each engine's own, and (with kvpool) the blocks stored for these engines."""
    for engine in engines.values():
        engine.serve({"op": "reset"})
    if master and namespace:
        from kvpool import Client
        with Client(master) as client:
            client.remove_prefix(namespace)


def reset_until_heard(engines: dict[str, Engine], master: str | None, namespace: str | None, service) -> None:
    """Reset, and again until the router has heard an event of each engine. A ZMQ subscriber gets only what is
    published after its subscription reaches the publisher, which takes a moment after connect() returns (longer
    on a loaded machine): a reset published before then is lost. Once one arrived, nothing later is missed."""
    from kvpool.net.netutil import wait_until

    deadline = time.monotonic() + 60
    while True:
        reset(engines, master, namespace)
        try:
            wait_until(lambda: all(f.batches for f in service.followers.values()), 5,
                       what="the router to hear from both engines")
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def summarize(results: list[dict], reference: list[dict] | None) -> dict:
    ttft = sorted(r["ttft_ms"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached"] for r in results)
    loaded = sum(r["kvpool"].get("blocks_loaded", 0) for r in results) * BLOCK
    return {"requests": len(results), "prompt_tokens": prompt, "computed_tokens": prompt - cached,
            "loaded_tokens": loaded, "local_hit_tokens": cached - loaded,
            "ttft_p50_ms": round(statistics.median(ttft), 1), "ttft_p90_ms": round(ttft[int(0.9 * (len(ttft) - 1))], 1),
            "identical_tokens": reference is None or all(mine["tokens"] == theirs["tokens"]
                                                         for mine, theirs in zip(results, reference)),
            "per_engine": {name: sum(r["engine"] == name for r in results) for name in ENGINES}}


def drive(args, python: str, work: Path) -> dict:
    from kvpool.connectors.block_keys import BlockNamespace
    from kvpool.connectors.router import RoundRobin
    from kvpool.connectors.routing_service import RoutingService

    if not Path(args.trace).is_file():
        raise SystemExit(f"no trace at {args.trace}: --trace names one (JSON lines with timestamp and hash_ids, as in "
                         "Mooncake's FAST'25 traces)")
    requests = workload(Path(args.trace), args.requests)
    conversations = len({r["conversation"] for r in requests})
    say = (lambda *a: None) if args.json_only else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"-- {len(requests)} requests of {conversations} conversations from {args.trace}")
    model = work / "model"
    make_model(model, max_tokens=2048)
    cluster, master = (None, args.master) if args.master else start_cluster(python, work, "512MiB")
    summary = {}
    reference = None
    try:
        for with_kvpool in (False, True):
            engines = start_engines(python, model, master if with_kvpool else None, work, args.json_only,
                                    args.local_blocks)
            try:
                # A request one block long on each: warms the engines, and says where their blocks go in kvpool.
                warm = [engine.serve({"op": "generate", "tokens": [2] * (BLOCK + 1)}) for engine in engines.values()]
                namespace = warm[0]["kvpool"].get("namespace")
                space = BlockNamespace.from_prefix(namespace) if namespace else BlockNamespace("local", "-", "-", BLOCK)
                for name, kvpool_on, policy in POLICIES:
                    if kvpool_on != with_kvpool:
                        continue
                    service = RoutingService({n: e.events for n, e in engines.items()}, space,
                                             master=master if with_kvpool else None).start()
                    try:
                        reset_until_heard(engines, master, namespace, service)
                        router = service if policy == "kv_aware" else RoundRobin(list(engines))
                        say(f"-- {name}")
                        started = time.monotonic()
                        results = serve_workload(engines, requests, router)
                        summary[name] = summarize(results, reference)
                        summary[name]["wall_s"] = round(time.monotonic() - started, 1)
                        if name == "no_kvpool":
                            reference = results
                        say(f"   {json.dumps(summary[name])}")
                    finally:
                        service.stop()
            finally:
                stop_engines(engines)
    finally:
        if cluster:
            cluster.terminate()
            cluster.wait(timeout=30)
    kv_aware = summary["kv_aware"]["computed_tokens"]
    summary["kv_aware_computed_vs_round_robin"] = round(kv_aware / max(1, summary["round_robin"]["computed_tokens"]), 3)
    summary["kv_aware_computed_vs_no_kvpool"] = round(kv_aware / max(1, summary["no_kvpool"]["computed_tokens"]), 3)
    summary["kv_aware_computed_vs_prompt"] = round(kv_aware / max(1, summary["kv_aware"]["prompt_tokens"]), 3)
    summary["workload"] = {"requests": len(requests), "conversations": conversations,
                           "prompt_tokens": summary["no_kvpool"]["prompt_tokens"], "local_blocks": args.local_blocks}
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=240, help="turns to serve (default 240)")
    parser.add_argument("--local-blocks", type=int, default=LOCAL_BLOCKS,
                        help=f"each engine's own KV cache, in {BLOCK}-token blocks (default {LOCAL_BLOCKS})")
    parser.add_argument("--trace", default=str(TRACE), help="the conversation trace (default: ../shared/traces)")
    parser.add_argument("--master", help="an existing kvpool master HOST:PORT (default: start a local cluster)")
    parser.add_argument("--json-only", action="store_true", help="print only the summary line")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--events-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        host, port = args.control.rsplit(":", 1)
        run_engine(args.engine, args.model, args.events_port, args.master, (host, int(port)),
                   bytes.fromhex(os.environ.pop("KVPOOL_ROUTING_KEY")), args.local_blocks)
        return 0
    from engine_venvs import ensure
    python = str(ensure("vllm"))
    if not args.drive:  # the driver runs in the engine venv, beside vLLM (it follows the engines' events)
        return subprocess.run([python, __file__, "--drive"] + (argv if argv is not None else sys.argv[1:])).returncode
    with tempfile.TemporaryDirectory(prefix="kvpool-routing-") as tmp:
        summary = drive(args, python, Path(tmp))
    print(json.dumps(summary), flush=True)
    ok = all(summary[name]["identical_tokens"] for name, _, _ in POLICIES)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
