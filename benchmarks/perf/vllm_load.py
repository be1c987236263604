"""A load through vLLM's OpenAI server with the plugin on, and the same load on vLLM alone: requests fail or not,
the plugin's state returns to zero or not, and the server's memory (every process of it) after the run.

    python benchmarks/perf/vllm_load.py --out docs/results/vllm-load/rows.jsonl      # in the vllm virtualenv

Per configuration (`plugin`: refreshkv at K = L/8 as the engine's method; `vllm`: no engine method), a server is
started, `--requests` completion requests of `--min-tokens` to `--max-tokens` prompt tokens (token ids: the opening
of one of `--openings` documents and a question of its own, `load_prompts`) are sent by `--clients` concurrent
streaming clients, `--cancel` of them closed after their third chunk, and the server's RSS (the sum over its process
tree) is sampled every second. Shared documents keep the prefill within what a 2-core CPU does in an hour: 1,000
prompts of their own, 3.8M tokens, are about 3 hours of prefill per server there (`--openings 0` runs that load).
The plugin logs how many requests hold its state whenever that changes (at DEBUG, which the script turns on): after
the run the last such line must say 0. One JSON row per configuration; a configuration already in `--out` is skipped
(resumable).
"""

import argparse
import concurrent.futures
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from openai import OpenAI

from refreshkv.runtime.loading import resolve_model_dir

BOOKS = Path(__file__).resolve().parents[2] / "data" / "books"
CONFIGS = {"plugin": {"refreshkv": {"method": "refreshkv", "budget_ratio": 0.125}}, "vllm": None}


def server_rss(server: psutil.Process) -> int:
    processes = [server, *server.children(recursive=True)]
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def serve(name: str, args, prompts: list[list[int]]) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = str(resolve_model_dir("smollm2-135m"))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", str(args.max_tokens + 64)]
    command += ["--max-num-seqs", str(args.clients)]
    if CONFIGS[name] is not None:
        command += ["--additional-config", json.dumps(CONFIGS[name])]
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG"}
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    process = psutil.Process(server.pid)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=3600, max_retries=0)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                client.models.list()
                break
            except Exception:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log_path.read_text()[-3000:]) from None
                time.sleep(2)
        peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], server_rss(process))
                time.sleep(1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rng = random.Random(0)
        cancelled = set(rng.sample(range(len(prompts)), round(args.cancel * len(prompts))))

        def one(i: int) -> str:
            stream = client.completions.create(
                model=folder, prompt=prompts[i], max_tokens=args.new_tokens, temperature=0, stream=True
            )
            for chunks, _ in enumerate(stream, start=1):
                if i in cancelled and chunks == 3:
                    stream.close()
                    return "cancelled"
            return "done"

        started = time.monotonic()
        outcomes: dict[str, int] = {}
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            for future in concurrent.futures.as_completed([pool.submit(one, i) for i in range(len(prompts))]):
                try:
                    outcome = future.result()
                except Exception as error:  # a failed request is counted, the load goes on
                    outcome = f"failed: {type(error).__name__}"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
        wall = time.monotonic() - started
        time.sleep(5)  # the engine's last steps: a finished request leaves the batch at the next one
        untouched = {"vllm_xargs": {"refreshkv": json.dumps({"method": "full"})}}  # holds no plugin state itself
        client.completions.create(model=folder, prompt=prompts[0][:64], max_tokens=2, extra_body=untouched)
        time.sleep(2)
        after = server_rss(process)
        done.set()
        held = re.findall(r"refreshkv: (\d+) requests hold plugin state", log_path.read_text())
        return {
            "config": name,
            "requests": len(prompts),
            "outcomes": outcomes,
            "wall_s": round(wall, 1),
            "rss_mb_after": round(after / 2**20),
            "rss_mb_peak": round(peak[0] / 2**20),
            "plugin_state_after": int(held[-1]) if held else None,
        }
    finally:
        server.terminate()
        server.wait(timeout=120)


def load_prompts(book: list[int], args, rng: random.Random) -> list[list[int]]:
    """`--requests` prompts of `--min-tokens` to `--max-tokens` tokens. With `--openings`, each is the start of one of
    that many documents (book passages) and then a question of its own (a passage of 64-256 tokens from anywhere in
    the books): the documents' blocks come from vLLM's prefix cache after their first prefill, each question's are
    prefilled. Without, each prompt is a passage of its own, all of it prefilled."""
    documents = [rng.randrange(len(book) - args.max_tokens) for _ in range(args.openings)]
    prompts = []
    for _ in range(args.requests):
        length = rng.randint(args.min_tokens, args.max_tokens)
        if not documents:
            start = rng.randrange(len(book) - length)
            prompts.append(book[start : start + length])
            continue
        question = rng.randint(64, 256)
        document, asked = rng.choice(documents), rng.randrange(len(book) - question)
        prompts.append(book[document : document + length - question] + book[asked : asked + question])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--min-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=7000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--cancel", type=float, default=0.05)
    parser.add_argument("--openings", type=int, default=16, help="documents the prompts begin with (0: none)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m")))
    text = " ".join(path.read_text(encoding="utf-8") for path in sorted(BOOKS.glob("austen-*.txt")))
    book = tokenizer.encode(text, add_special_tokens=False)
    prompts = load_prompts(book, args, random.Random(1))
    done = set()
    if args.out.exists():
        done = {json.loads(line)["config"] for line in args.out.read_text().splitlines() if line.strip()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in CONFIGS:
        if name in done:
            continue
        row = serve(name, args, prompts)
        row["command"] = "python benchmarks/perf/vllm_load.py " + " ".join(
            f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()
        )
        print(json.dumps(row), flush=True)
        with open(args.out, "a", encoding="utf-8") as rows:
            rows.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
