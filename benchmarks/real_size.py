"""Decode and prefill speed on real-size GGUF files, side by side with llama.cpp in one run.

    .venv/bin/python benchmarks/real_size.py FILE.gguf [FILE.gguf ...] \
        [--llama-bench /work/llamacpp-build/bin/llama-bench] \
        [--llama-server /work/llamacpp-build/bin/llama-server] [--threads 2] [--repeats 3]
        [--weight-layout stream|file]

Files of real shapes come from ``benchmarks/real_size_gguf.py``. For each file, in one process
per file (so that load time and RSS are the file's alone): load time, RSS growth at load (right
after ``LLM(...)`` returns; split into anonymous memory and mapped file pages, which weights
kept as views of the file are and which the page cache shares with other processes) and after
the decode and prefill runs (when every weight has been read), the time to the first token
(``LLM(...)`` plus one completion of one token for a short text prompt), decode tokens/s of one
greedy sequence (64 tokens after a 32-token prompt), prefill tokens/s of a 512-token prompt,
the weight bytes one decode step streams (every matmul weight and the output head, from the
loaded model) and the rate that makes at the measured step time, against the best read
bandwidth of the same machine measured in the same run (a torch sum over 512 MiB with the same
threads, at the start and again in the file's process right before and right after each
decode run: the shared host's rate drifts, so each decode run is also divided by the mean of
the two reads around it, and the median of those paired ratios is printed). With
``--llama-bench``: ``llama-bench -p 512 -n 64`` on the same file, and the ratios. With
``--llama-server``: llama.cpp's time to the first token on the same file (the server started on
a free local port with ``-t THREADS -c 2048``, ``/health`` polled until it answers 200, one
completion of one token for the same prompt; then the server is stopped), and our time against
it. Prints a table; median of the repeats with the range.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

PROMPT_TOKENS = 32
DECODE_TOKENS = 64
PREFILL_TOKENS = 512
KV_BLOCKS = 72
"""The KV pool in blocks of 16 tokens, for every model alike (1,152 tokens: the longest run
takes 513), where 64 MiB would hold only 288 tokens of the 3B's float32 KV."""
#: The prompt of the first-token measurements (ours and llama-server's).
FIRST_PROMPT = "The capital of France is"


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_parts() -> dict[str, int]:
    """``RssAnon`` and ``RssFile`` of ``/proc/self/status``, in bytes."""
    parts = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                parts[key] = int(value.split()[0]) * 1024
    return parts


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """GB/s of a torch sum over 512 MiB of float32 (best of ``repeats``)."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(128 << 20)
    data.sum()
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def streamed_bytes(llm: object) -> int:
    """Bytes of the matmul weights one decode step reads: every packed weight and dense
    Linear weight of the model (the token embedding reads one row; a tied head counts once)."""
    from torch import nn

    from prefixserve.model.weights.quant import QuantEmbedding, QuantLinear

    model = llm.engine.runner.model  # type: ignore[attr-defined]
    total, seen = 0, set()
    for module in model.modules():
        tensor = None
        if isinstance(module, QuantLinear):
            tensor = module.qweight
        elif isinstance(module, nn.Linear):
            tensor = module.weight
        elif isinstance(module, QuantEmbedding):
            tensor = module.head.qweight
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def measure_file(path: str, threads: int, repeats: int, layout: str
                 ) -> dict[str, float | list[float]]:
    """One file's figures, in this process, packed Q4_0 weights in ``layout``."""
    from prefixserve import LLM, SamplingParams

    before, parts_before = rss_bytes(), rss_parts()
    start = time.perf_counter()
    llm = LLM(path, num_threads=threads, max_model_len=2048, num_blocks=KV_BLOCKS,
              weight_layout=layout)
    load = time.perf_counter() - start
    growth = rss_bytes() - before
    parts = {k: v - parts_before[k] for k, v in rss_parts().items()}
    llm.generate(FIRST_PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
    first_token = time.perf_counter() - start
    top = min(llm.get_tokenizer().vocab_size, 40000)
    rng = random.Random(0)
    decode, prefill, reads, reads_after = [], [], [], []
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(repeats + 1):
        llm.reset_prefix_cache()
        prompt = [rng.randrange(1000, top) for _ in range(PROMPT_TOKENS)]
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        if i:
            reads.append(read_bandwidth(threads, 3))
        start = time.perf_counter()
        llm.generate(prompt + [7], params)
        spent = time.perf_counter() - start
        if i:
            reads_after.append(read_bandwidth(threads, 3))
        long = [rng.randrange(1000, top) for _ in range(PREFILL_TOKENS)]
        start = time.perf_counter()
        llm.generate(long, one)
        if i:  # the first round warms up
            decode.append(DECODE_TOKENS / spent)
            prefill.append(PREFILL_TOKENS / (time.perf_counter() - start))
    settled = {k: v - parts_before[k] for k, v in rss_parts().items()}
    return {"load_s": load, "first_token_s": first_token, "rss_growth": growth,
            "rss_anon": parts["RssAnon"], "rss_file": parts["RssFile"],
            "settled_anon": settled["RssAnon"], "settled_file": settled["RssFile"],
            "file_bytes": os.path.getsize(path),
            "streamed": streamed_bytes(llm), "decode": decode, "prefill": prefill,
            "reads": reads, "reads_after": reads_after}


def llama_bench(binary: str, path: str, threads: int, repeats: int) -> dict[str, float]:
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", str(PREFILL_TOKENS),
                          "-n", str(DECODE_TOKENS), "-r", str(repeats), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out[out.index("["):])
    result = {}
    for row in rows:
        key = "prefill" if row["n_prompt"] else "decode"
        result[key] = float(row["avg_ts"])
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_server_first_token(binary: str, path: str, threads: int) -> dict[str, float]:
    """Seconds from starting ``llama-server`` on ``path`` to its ``/health`` answering 200
    (``ready_s``) and to the answer of one completion of one token (``first_token_s``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    local = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
    start = time.perf_counter()
    server = subprocess.Popen([binary, "-m", path, "-t", str(threads), "-c", "2048",
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited with {server.returncode}")
            try:
                with local.open(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass  # not listening yet, or 503 while it loads
            time.sleep(0.01)
        ready = time.perf_counter() - start
        body = json.dumps({"prompt": FIRST_PROMPT, "n_predict": 1, "temperature": 0.0})
        request = urllib.request.Request(f"{url}/completion", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with local.open(request, timeout=120) as answer:
            answer.read()
        return {"ready_s": ready, "first_token_s": time.perf_counter() - start}
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def report(path: str, mine: dict, bandwidth: float, peer: dict[str, float] | None,
           server: dict[str, float] | None = None) -> None:
    name = os.path.basename(path)
    decode = statistics.median(mine["decode"])
    gbs = mine["streamed"] * decode / 1e9
    print(f"\n## {name}  ({mine['file_bytes'] / 2**20:.0f} MiB)")
    print(f"load {mine['load_s']:.2f} s; RSS growth {mine['rss_growth'] / 2**20:.0f} MiB "
          f"= {mine['rss_growth'] / mine['file_bytes']:.2f}x the file (anonymous "
          f"{mine['rss_anon'] / 2**20:.0f} MiB, file pages {mine['rss_file'] / 2**20:.0f} MiB)")
    settled = mine["settled_anon"] + mine["settled_file"]
    print(f"RSS growth after the runs {settled / 2**20:.0f} MiB = "
          f"{settled / mine['file_bytes']:.2f}x the file (anonymous "
          f"{mine['settled_anon'] / 2**20:.0f} MiB, file pages "
          f"{mine['settled_file'] / 2**20:.0f} MiB)")
    print(f"first token (LLM() + one token): {mine['first_token_s']:.2f} s")
    if server:
        print(f"llama-server first token: {server['first_token_s']:.2f} s (ready after "
              f"{server['ready_s']:.2f} s); ours / llama.cpp's = "
              f"{mine['first_token_s'] / server['first_token_s']:.2f}x")
    best = max([bandwidth, *mine["reads"]])
    print(f"decode 1 seq: {summary(mine['decode'])} tok/s; {mine['streamed'] / 2**20:.0f} MiB "
          f"streamed per token = {gbs:.1f} GB/s, {gbs / best:.0%} of the best read rate "
          f"({best:.1f} GB/s; before each decode run {min(mine['reads']):.1f}-"
          f"{max(mine['reads']):.1f})")
    paired = [100 * mine["streamed"] * rate / 1e9 / ((before + after) / 2) for rate, before, after
              in zip(mine["decode"], mine["reads"], mine["reads_after"], strict=True)]
    print(f"weights streamed / the read rate around the same decode run (paired, per run): "
          f"{summary(paired)}%")
    print(f"prefill {PREFILL_TOKENS}: {summary(mine['prefill'])} tok/s")
    if peer:
        print(f"llama-bench: tg{DECODE_TOKENS} {peer['decode']:.1f} tok/s "
              f"(ratio {decode / peer['decode']:.2f}x); pp{PREFILL_TOKENS} "
              f"{peer['prefill']:.1f} (ratio "
              f"{statistics.median(mine['prefill']) / peer['prefill']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--llama-server", default=None,
                        help="llama-server binary: time its load to the first token too")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weight-layout", choices=("stream", "file"), default="stream",
                        help="packed Q4_0 weights' layout (the engine's --weight-layout)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # child: one file, figures as JSON on the last line
        print(json.dumps(measure_file(args.files[0], args.threads, args.repeats,
                                      args.weight_layout)))
        return
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth ({args.threads} threads, torch sum of 512 MiB): {bandwidth:.1f} GB/s")
    for path in args.files:
        out = subprocess.run([sys.executable, __file__, "--one", path, "--threads",
                              str(args.threads), "--repeats", str(args.repeats),
                              "--weight-layout", args.weight_layout],
                             capture_output=True, text=True, check=True).stdout
        mine = json.loads(out.strip().splitlines()[-1])
        peer = (llama_bench(args.llama_bench, path, args.threads, args.repeats)
                if args.llama_bench else None)
        server = (llama_server_first_token(args.llama_server, path, args.threads)
                  if args.llama_server else None)
        report(path, mine, bandwidth, peer, server)


if __name__ == "__main__":
    main()
