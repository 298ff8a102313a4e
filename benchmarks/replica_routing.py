"""Prefix-aware routing over Ray Serve replicas, served, against the estimate on the same requests.

Starts ``prefixserve serve --replicas N`` on a local Ray cluster (N engine replicas of the default
model, each with ``--num-blocks B``), runs ``prefixserve bench --dataset shared-prefix`` against
it with 16 clients (``--save-prompts`` keeps the prompts it sent, with their replies), and then
``prefixserve estimate --replicas N --capacity B --concurrency 16 --clients 16`` on those
prompts (16 closed-loop clients, as the bench's). For each run it prints the share of prompt
tokens the replicas served from their caches, the estimate's prefix-aware, round-robin and
pooled figures, the prefix-aware figure of the window load model (``--in-flight 16``), and
how many requests the ingress's router sent to the replica it first chose for them (``GET
/router/replicas``, ``first_choice``: a request is chosen again, after a backoff, when its
replica is full when Ray Serve tries it), with the run's completed requests per second and mean
time to first token.

Usage (about 4 minutes on 2 cores)::

    .venv/bin/python benchmarks/replica_routing.py [--replicas 4] [--num-blocks 256] [--runs 2]
        [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from hostile_clients import Server  # noqa: E402

from prefixserve.router.policy import default_balance_abs  # noqa: E402

ADMIN = "routing-admin"
CLIENTS = 16
SLOTS = 4
"""Sequence slots per replica (``--max-num-seqs``)."""


def first_choices(server: Server) -> dict[str, int]:
    response = httpx.get(server.url + "/router/replicas", timeout=60,
                         headers={"Authorization": f"Bearer {ADMIN}"})
    response.raise_for_status()
    data = response.json()
    counts = {"kept": 0, "changed": 0, "imbalanced": 0}
    for router in data.get("routers", [data]):  # one router per handle of the ingress
        for key in ("kept", "changed"):
            counts[key] += router["first_choice"][key]
        counts["imbalanced"] += router.get("reasons", {}).get("imbalanced", 0)
    return counts


def prefixserve(*arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "prefixserve", *arguments], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)


def one_run(server: Server, folder: Path, seed: int, args: argparse.Namespace
            ) -> dict[str, Any]:
    log, run, est = (folder / f"{name}-{seed}.json" for name in ("prompts", "bench", "est"))
    before = first_choices(server)
    prefixserve("bench", "--base-url", server.url + "/v1", "--dataset", "shared-prefix",
                "--num-groups", str(args.groups), "--prompts-per-group", "8",
                "--system-prompt-len", "512", "--question-len", "32", "--output-len", "16",
                "--max-concurrency", str(CLIENTS), "--seed", str(seed), "--save-prompts",
                str(log), "--json", str(run), "--no-progress")
    after = first_choices(server)
    common = ["estimate", str(log), "--replicas", str(args.replicas), "--capacity",
              str(args.num_blocks), "--concurrency", str(CLIENTS), "--no-progress",
              "--balance-abs-threshold", str(args.balance_abs_threshold)]
    prefixserve(*common, "--clients", str(CLIENTS), "--routing",
                "prefix-aware,round-robin,pooled", "--json", str(est))
    window = folder / f"window-{seed}.json"
    prefixserve(*common, "--in-flight", str(CLIENTS), "--routing", "prefix-aware", "--json",
                str(window))
    served = json.loads(run.read_text())["summary"]
    figures = {r["routing"]: r["token_hit_rate"] for r in json.loads(est.read_text())["results"]}
    figures["window"] = json.loads(window.read_text())["results"][0]["token_hit_rate"]
    moved = next(r for r in json.loads(est.read_text())["results"]
                 if r["routing"] == "prefix-aware")["reasons"].get("imbalanced", 0)
    kept = after["kept"] - before["kept"]
    changed = after["changed"] - before["changed"]
    return {"served": served["cached_share"], "completed": served["completed"],
            "errors": served["errors"], **figures, "kept": kept, "changed": changed,
            "moved": after["imbalanced"] - before["imbalanced"], "moved_estimate": moved,
            "rps": served["request_throughput"], "ttft": served["ttft_ms"]["mean"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=256,
                        help="KV blocks per replica (default 256)")
    parser.add_argument("--groups", type=int, default=8,
                        help="system prompts of the dataset, 8 questions each (default 8)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--balance-abs-threshold", type=int,
                        default=default_balance_abs(SLOTS), metavar="N",
                        help="the router's rule, in the cluster and the estimate (default "
                        f"{default_balance_abs(SLOTS)}: serve's for {SLOTS} slots)")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the prompts sent, the bench's and the estimates' JSON in DIR")
    parser.add_argument("--server-args", default="",
                        help="more flags of the cluster, e.g. '--max-ongoing-requests 8'")
    args = parser.parse_args()
    print("$ " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="prefixserve-routing-") as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        server = Server(["--replicas", str(args.replicas), "--admin-key", ADMIN,
                         "--dtype", "float32", "--max-num-seqs", str(SLOTS), "--num-threads", "1",
                         "--num-blocks", str(args.num_blocks), "--max-model-len", "2048",
                         "--ray-num-cpus", "2", "--ray-replica-cpus", "0.4",
                         "--balance-abs-threshold", str(args.balance_abs_threshold),
                         *args.server_args.split()],
                        folder / "cluster.log").start()
        try:
            for seed in range(args.runs):
                rows.append(one_run(server, folder, seed + 1, args))
        finally:
            print(f"cluster exit status {server.stop()}")
    print("| run | completed | served from cache | estimate prefix-aware | served - estimate "
          "| window estimate | round-robin | pooled | to the first choice | moved by the "
          "balance rule, served / estimate | req/s | mean TTFT ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, row in enumerate(rows, 1):
        total = row["kept"] + row["changed"]
        share = row["kept"] / total if total else float("nan")
        print(f"| {i} | {row['completed']} ({row['errors']} errors) | {row['served']:.1%} | "
              f"{row['prefix-aware']:.1%} | {100 * (row['served'] - row['prefix-aware']):+.1f} "
              f"pts | {row['window']:.1%} | {row['round-robin']:.1%} | {row['pooled']:.1%} | "
              f"{row['kept']} of {total} ({share:.1%}) | {row['moved']} / "
              f"{row['moved_estimate']} | {row['rps']:.2f} | {row['ttft']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
