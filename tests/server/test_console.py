"""The console (server/console/): its page driven in a real headless Chromium, and its JSON routes,
on one server with two tenants' API keys and an admin key.

The browser tests need Debian's ``chromium`` and ``chromium-driver`` (``make install`` puts them
in as root) and skip, saying so, without them. Their screenshots go to ``$CONSOLE_SCREENSHOTS``
(default: the test's temporary folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import HTTP, ServerProcess, idle, serve_for_module

from prefixserve.server.console.routes import ASSETS

KEY_A, KEY_B, ADMIN = "console-tenant-a", "console-tenant-b", "console-admin"
NUM_BLOCKS = 128
SYSTEM = ("You are the support assistant of a bicycle shop. You answer questions about "
          "repairs, parts, prices and opening hours in one short sentence, politely, and you "
          "never invent a part the shop does not sell.")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("console")
    yield from serve_for_module(
        ["--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN,
         "--num-blocks", str(NUM_BLOCKS), "--max-model-len", "512", "--max-num-seqs", "4",
         "--log-stats-interval", "0"],
        folder / "server.log")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def view(server: ServerProcess, key: str) -> dict[str, Any]:
    response = HTTP.get(server.url + "/v1/cache/view", headers=auth(key), timeout=30)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


# ----------------------------------------------------------------------------- JSON routes


def test_the_console_routes_ask_for_a_key_and_only_an_admin_gets_the_log(
        server: ServerProcess) -> None:
    for path in ("/v1/cache/view", "/v1/cache/requests", "/v1/cache/what_if"):
        missing = HTTP.get(server.url + path)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == \
            "missing_api_key"
        assert HTTP.get(server.url + path, headers=auth("wrong")).status_code == 401
    for path in ("/v1/cache/requests", "/v1/cache/what_if"):
        refused = HTTP.get(server.url + path, headers=auth(KEY_A))
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["type"] == "permission_error"


def test_a_tenant_sees_only_its_own_namespace_and_an_admin_sees_both_by_name(
        server: ServerProcess) -> None:
    for key in (KEY_A, KEY_B):
        for question in ("Do you fix flat tyres?", "When do you open?"):
            response = HTTP.post(server.url + "/v1/chat/completions", headers=auth(key),
                                  timeout=120, json={"max_tokens": 2, "messages": [
                                      {"role": "system", "content": f"{SYSTEM} ({key})"},
                                      {"role": "user", "content": question}]})
            assert response.status_code == 200, response.text
    salted = HTTP.post(server.url + "/v1/completions", headers=auth(KEY_A), timeout=120,
                        json={"prompt": "Hello there", "max_tokens": 1, "cache_salt": "team"})
    assert salted.status_code == 200, salted.text
    mine = view(server, KEY_A)
    assert mine["role"] == "tenant" and "tiers" not in mine
    names = {n["name"]: n for n in mine["namespaces"]}
    assert set(names) == {"yours", "yours, salt 'team'"}
    assert names["yours"]["sequences"] + 1 == mine["counters"]["sequences"] >= 3
    assert "salt 'team'" not in json.dumps(view(server, KEY_B))
    assert all(p["namespace"] == "yours" for p in mine["prefixes"]) and mine["prefixes"]
    admin = view(server, ADMIN)
    by_name = {n["name"]: n for n in admin["namespaces"]}
    assert {"API key #1", "API key #2", "API key #1, salt 'team'"} <= set(by_name)
    assert by_name["API key #1"]["sequences"] == names["yours"]["sequences"]
    assert {p["hash"] for p in mine["prefixes"]} < {p["hash"] for p in admin["prefixes"]}
    assert KEY_A not in json.dumps(admin) and KEY_B not in json.dumps(admin)


def test_the_what_if_equals_the_estimate_on_the_servers_request_log(
        server: ServerProcess, tmp_path: Path) -> None:
    """Twelve 180-token documents, each asked about twice, overflow the 128-block pool: the
    sizes differ. The test runs the estimator itself on the log the server hands out."""
    documents = [[200 + 300 * d + i for i in range(180)] for d in range(12)]
    for round_ in range(2):
        for d, document in enumerate(documents):
            response = HTTP.post(server.url + "/v1/completions", headers=auth(KEY_A),
                                  timeout=120, json={"prompt": document + [9, round_, d],
                                                     "max_tokens": 1})
            assert response.status_code == 200, response.text
    log = HTTP.get(server.url + "/v1/cache/requests", headers=auth(ADMIN), timeout=30)
    assert log.status_code == 200 and log.headers["content-type"] == "application/jsonl"
    path = tmp_path / "requests.jsonl"
    path.write_bytes(log.content)
    answer = HTTP.get(server.url + "/v1/cache/what_if", headers=auth(ADMIN),
                       params={"replicas": 3}, timeout=300)
    assert answer.status_code == 200, answer.text
    what_if = answer.json()
    assert what_if["requests"] == len(log.text.splitlines())
    sizes = estimate(tmp_path, path, "--capacity", "64,128,256,512")["caches"]
    assert [(s["capacity_blocks"], s["token_hit_rate"], s["block_hit_rate"]) for s in sizes] \
        == [(s["capacity_blocks"], s["token_hit_rate"], s["block_hit_rate"])
            for s in what_if["sizes"]]
    assert len({s["token_hit_rate"] for s in sizes}) > 1, sizes  # the sizes do differ
    tier = next(c for c in estimate(tmp_path, path, "--capacity", "128", "--tier-capacity",
                                    "1024")["caches"] if not c["infinite"])
    assert (tier["token_hit_rate"], tier["tier_token_hit_rate"]) == (
        what_if["tier"]["token_hit_rate"], what_if["tier"]["tier_token_hit_rate"])
    assert tier["tier_token_hit_rate"] > 0
    replicas = estimate(tmp_path, path, "--capacity", "128", "--replicas", "3", "--routing",
                        "prefix-aware,round-robin")["results"]
    assert [(r["routing"], r["token_hit_rate"]) for r in replicas] == [
        (r["routing"], r["token_hit_rate"]) for r in what_if["replicas"]]


def estimate(folder: Path, log: Path, *options: str) -> dict[str, Any]:
    """``prefixserve estimate`` on ``log`` as a user runs it, its ``--json`` figures."""
    out = folder / "estimate.json"
    subprocess.run([sys.executable, "-m", "prefixserve", "estimate", str(log), "--no-progress",
                    *options, "--json", str(out)], check=True, capture_output=True, timeout=300)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_the_page_and_its_files_are_served_from_the_package_and_stay_small(
        server: ServerProcess) -> None:
    page = HTTP.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    total = len(page.content)
    for name, media_type in ASSETS.items():
        asset = HTTP.get(f"{server.url}/console/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"] == media_type
        assert f"/console/{name}" in page.text
        total += len(asset.content)
    assert total < 300_000
    assert "http://" not in page.text and "https://" not in page.text  # no CDN
    assert HTTP.get(server.url + "/console/..%2fserver.log").status_code == 404
    assert HTTP.get(server.url + "/console/routes.py").status_code == 404


# ----------------------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no chromium and chromedriver: install Debian's chromium and "
                    "chromium-driver (make install does, as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    options.binary_location = chromium
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


@pytest.fixture()
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("CONSOLE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wait_for(condition: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Polls ``condition`` until it returns something true; fails if never."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s")
        time.sleep(0.1)


def open_with_key(driver: Any, server: ServerProcess, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(server.url + "/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(server.url + "/")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "save-key").click()
    wait_for(lambda: "viewing as" in driver.find_element(By.ID, "who").text)


def chat(driver: Any, system: str, question: str) -> dict[str, Any]:
    """Sends one chat turn on the page; returns the streamed answer and its figures."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "tab-chat").click()
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#model option"))
    driver.find_element(By.ID, "clear").click()
    driver.find_element(By.ID, "system").clear()
    driver.find_element(By.ID, "system").send_keys(system)
    driver.find_element(By.ID, "temperature").clear()
    driver.find_element(By.ID, "temperature").send_keys("0")
    driver.find_element(By.ID, "max_tokens").clear()
    driver.find_element(By.ID, "max_tokens").send_keys("12")
    driver.find_element(By.ID, "user").send_keys(question)
    driver.find_element(By.ID, "send").click()
    stats = wait_for(lambda: [s for s in driver.find_elements(By.CSS_SELECTOR, ".answer-stats")
                              if s.get_attribute("data-cached") is not None])[-1]
    answer = driver.find_elements(By.CSS_SELECTOR, ".message.assistant .text")[-1].text
    return {"answer": answer, "cached": int(stats.get_attribute("data-cached")),
            "prompt": int(stats.get_attribute("data-prompt")), "figures": stats.text}


#: The page's tables, read in one script: the page redraws them at every poll, and elements
#: found one by one may be replaced in between (a stale element).
READ_TABLES = """
const rows = (id) => [...document.querySelectorAll(`#${id} tbody tr`)].map(
    (tr) => [...tr.cells].map((td) => td.textContent));
return {hit_rate: document.getElementById("hit-rate").textContent,
        namespaces: rows("namespace-table"), prefixes: rows("prefix-table"),
        pins: rows("pin-table")};
"""


def cache_tab(driver: Any) -> dict[str, Any]:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "tab-cache").click()
    tables: dict[str, Any] = driver.execute_script(READ_TABLES)
    return tables


def test_a_tenant_chats_on_the_page_and_sees_the_second_turn_hit_the_cache(
        server: ServerProcess, browser: Any, shots: Path) -> None:
    open_with_key(browser, server, KEY_B)
    system = ("You are the librarian of a small town. You help readers find books, renew "
              "their loans and book the reading room, in two sentences at most.")
    first = chat(browser, system, "Can you true a wheel?")
    assert first["answer"] and first["cached"] < 32, first
    before = wait_for(lambda: (lambda c: c if c["hit_rate"] != "-" else None)(
        cache_tab(browser)))
    second = chat(browser, system, "How much is a chain?")
    browser.save_screenshot(str(shots / "console-chat.png"))
    assert second["answer"] and second["cached"] >= 32, second  # the system prompt's blocks
    assert f"cached {second['cached']} of {second['prompt']} prompt tokens" in second["figures"]
    after = wait_for(lambda: (lambda c: c if c["hit_rate"] != before["hit_rate"] and len(
        c["prefixes"]) > len(before["prefixes"]) else None)(cache_tab(browser)), 30)
    browser.save_screenshot(str(shots / "console-cache-tenant.png"))
    assert [row[0] for row in after["namespaces"]] == ["yours"]
    assert all(row[4] == "yours" for row in after["prefixes"])
    old = {row[0] for row in before["prefixes"]}
    [new] = [row for row in after["prefixes"] if row[0] not in old]
    assert (int(new[1]), int(new[2]), new[5]) == (second["cached"], 1, "KV cache"), new


def test_another_tenant_sees_nothing_of_the_first_and_an_admin_sees_both(
        server: ServerProcess, browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    mine = view(server, KEY_A)
    open_with_key(browser, server, KEY_A)
    seen = wait_for(lambda: (lambda c: c if c["namespaces"] else None)(cache_tab(browser)))
    assert [row[0] for row in seen["namespaces"]] == ["yours", "yours, salt 'team'"]
    assert {row[0] for row in seen["prefixes"]} == {p["hash"] for p in mine["prefixes"]}
    other = {p["hash"] for p in view(server, KEY_B)["prefixes"]}
    assert other and not other & {row[0] for row in seen["prefixes"]}
    assert not browser.find_element(By.ID, "tier-table").is_displayed()
    assert not browser.find_element(By.ID, "pin-table").is_displayed()
    pinned = HTTP.post(server.url + "/v1/pins", headers=auth(ADMIN), timeout=60, json={
        "id": "handbook", "prompt_token_ids": list(range(4000, 4040)), "for_api_key": KEY_A})
    assert pinned.status_code == 200, pinned.text
    open_with_key(browser, server, ADMIN)
    everything = wait_for(lambda: (lambda c: c if len(c["namespaces"]) >= 2 else None)(
        cache_tab(browser)))
    pins = wait_for(lambda: cache_tab(browser)["pins"])
    ttft = browser.find_element(By.ID, "ttft-chart")
    wait_for(lambda: int(ttft.get_attribute("data-requests") or 0) > 0)  # from /metrics
    browser.save_screenshot(str(shots / "console-cache-admin.png"))
    assert {"API key #1", "API key #2"} <= {row[0] for row in everything["namespaces"]}
    assert pins == [["handbook", "2", "40"]]
    assert HTTP.delete(server.url + "/v1/pins/handbook", headers=auth(ADMIN)).status_code == 200


def test_an_admin_runs_the_what_if_on_the_page(server: ServerProcess, browser: Any,
                                               shots: Path) -> None:
    from selenium.webdriver.common.by import By

    for _ in range(2):  # a log to replay, whichever tests ran before
        assert HTTP.post(server.url + "/v1/completions", headers=auth(KEY_A), timeout=120,
                          json={"prompt": list(range(500, 540)), "max_tokens": 1}
                          ).status_code == 200
    open_with_key(browser, server, ADMIN)
    browser.find_element(By.ID, "tab-whatif").click()
    browser.find_element(By.ID, "whatif-run").click()
    wait_for(lambda: "replayed" in browser.find_element(By.ID, "whatif-status").text, 120)
    rows = [tr.text for tr in browser.find_elements(By.CSS_SELECTOR, "#whatif-table tbody tr")]
    browser.save_screenshot(str(shots / "console-what-if.png"))
    expected = HTTP.get(server.url + "/v1/cache/what_if", headers=auth(ADMIN), timeout=300)
    assert len(rows) == len(expected.json()["sizes"]) + 1 + 2  # sizes, the tier, 2 routings
    assert rows[0].startswith("0.5x the KV memory 64")
    assert "prefixserve estimate requests.jsonl" in browser.find_element(
        By.ID, "whatif-commands").text
    load_ms = browser.execute_script(
        "const t = performance.getEntriesByType('navigation')[0]; return t.loadEventEnd;")
    print(f"console page loaded in {load_ms:.0f} ms")
    server.wait_for_metrics(idle)
