"""``prefixserve estimate`` per LoRA id: hand-counted hits in each adapter's namespace and with
the namespaces shared (the cost of the split), in the table and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_hit_rates_per_lora_id_and_the_cost_of_splitting(tmp_path: Path) -> None:
    """Blocks of 4; a 9-token prompt has 2 full blocks (8 tokens can hit). Kills: the LoRA id
    left out of the hashes (B would hit), the shared replay keyed like the split one (no cost),
    requests of one id counted under another."""
    prompt = list(range(1, 10))
    records = [
        {"token_ids": prompt, "lora_id": "A"},  # 0; shared 0 (first ever)
        {"token_ids": prompt, "lora_id": "B"},  # 0; shared 8
        {"token_ids": prompt, "lora_id": "A"},  # 8; shared 8
        {"token_ids": prompt},                  # base: 0; shared 8
        {"token_ids": prompt},                  # 8; shared 8
    ]
    path = tmp_path / "lora.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "prefixserve", "estimate", str(path),
                           "--block-size", "4", "--capacity", "100", "--json", str(out)],
                          capture_output=True, text=True, check=True)
    figures = {f["lora_id"]: f for f in json.loads(out.read_text())["lora"]}
    assert {k: (f["requests"], f["prompt_tokens"], f["hit_tokens"], f["shared_hit_tokens"])
            for k, f in figures.items()} == {None: (2, 18, 8, 16), "A": (2, 18, 8, 8),
                                             "B": (1, 9, 0, 8)}
    text = " ".join(done.stdout.split())  # the console wraps long lines
    assert "Per LoRA adapter" in text
    assert ("35.6% of prompt tokens from the cache, 71.1% if all requests shared one "
            "namespace; 16 more prompt tokens to compute") in text, text


def test_no_lora_table_without_lora_ids(tmp_path: Path) -> None:
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"token_ids": list(range(1, 10))}) + "\n")
    done = subprocess.run([sys.executable, "-m", "prefixserve", "estimate", str(path),
                           "--capacity", "100"], capture_output=True, text=True, check=True)
    assert "Per LoRA adapter" not in done.stdout
