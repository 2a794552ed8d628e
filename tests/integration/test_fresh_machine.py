"""A fresh machine whose llama.cpp build faults (a native build's AMX kernels on some Xeons): `mirror-sd up`
still becomes ready, drafting with suffix drafts alone, says so once and everywhere an operator looks, serves
greedy output identical to the target alone, and leaves no child behind when it is killed with SIGKILL. `up` runs
with its defaults, so the worker that drafts is the one its placement picks on this box: the verify worker on 2
cores or fewer (placement local), a draft worker beside it on more.

The faulting build is tests/fixtures/faulty_llama_cpp, first on every child's PYTHONPATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import redis

from services.stack import choose_placement, free_port
from tests.conftest import REPO_ROOT
from tests.integration.conftest import FAULTY_LLAMA_CPP, private_cache, up_verify_threads

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three rivers in Europe and say where each one ends."}]


def wait_ready(port: int, up: subprocess.Popen, log_path, timeout_s: float = 180) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        assert up.poll() is None, log_path.read_text()[-4000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("not ready: " + log_path.read_text()[-4000:])


def dashboard_shows_the_fallback(port: int, drafter: str) -> None:
    """In a real headless Chromium: the badge on the drafting worker's row (`drafter`: its id's prefix), the
    sentence under the drafts' table, and the processes of `up` (MIRROR_SD_FALLBACK_SCREENSHOT=path saves what
    it looks like)."""
    table = "#pools" if drafter == "verify" else "#drafts"
    from tests.integration.browser import chromium_page

    with chromium_page(viewport={"width": 1400, "height": 1000}) as (page, errors):
        page.goto(f"http://127.0.0.1:{port}/dashboard")
        page.wait_for_selector(f'{table} tr[data-worker^="{drafter}-"] .badge.alert:has-text("fallback (SIGSEGV)")',
                               timeout=30_000)
        note = page.locator("#drafts .fallback-note").first.text_content()
        assert re.fullmatch(drafter + r"-\S+: draft suffix:gguf:smollm2-135m cannot run here: llama.cpp crashed "
                            r"with SIGSEGV in llama_decode \(build uses AMX_INT8, AVX512, AVX2, AVX\); drafting with "
                            r"suffix instead", note)
        child = "draft-worker" if drafter == "draft" else "verify-worker"
        page.wait_for_selector(f'#children tr[data-child="{child}"] td.state:has-text("running")', timeout=10_000)
        if os.environ.get("MIRROR_SD_FALLBACK_SCREENSHOT"):
            page.screenshot(path=os.environ["MIRROR_SD_FALLBACK_SCREENSHOT"], full_page=False)
        assert not errors, errors


def chat(port: int, **extra) -> dict:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "messages": QUESTION, "max_tokens": 40, "temperature": 0,
        "return_token_ids": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_up_on_a_faulting_llama_cpp_serves_with_suffix_drafts_and_dies_with_its_supervisor(tmp_path, redis_url,
                                                                                           warm_up_profile):
    client = redis.Redis.from_url(redis_url)
    port = free_port()
    drafter = "verify" if choose_placement("auto", "cpu") == "local" else "draft"  # the worker that drafts
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(FAULTY_LLAMA_CPP), str(REPO_ROOT)]),
           "MIRROR_SD_REDIS_URL": redis_url,
           "MIRROR_SD_DATABASE_URL": f"sqlite:///{tmp_path / 'up.db'}",
           "MIRROR_SD_CACHE_DIR": str(private_cache(tmp_path))}  # this test's engine verdicts stay its own
    warm_up_profile(up_verify_threads(model_draft=True, local=drafter == "verify"))
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        seconds = wait_ready(port, up, log_path)
        ready_at = time.time()
        fallback, = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json()["draft_fallbacks"]
        print(f"ready {seconds:.1f}s after `up` started, {ready_at - fallback['since']:.1f}s after the draft's "
              "engine crashed in its check, drafting with the fallback")
        assert fallback["draft"] == "suffix:gguf:smollm2-135m" and fallback["serving"] == "suffix"
        assert fallback["fault"] == "SIGSEGV"
        assert fallback["reason"].startswith("llama.cpp crashed with SIGSEGV in llama_decode (build uses AMX_INT8")

        speculative, plain = chat(port, cache_salt="sd"), chat(port, route="ar", cache_salt="ar")
        assert speculative["mirror_sd"]["route"] == "sd" and plain["mirror_sd"]["route"] == "ar"
        assert speculative["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
        assert speculative["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]

        status = subprocess.run([sys.executable, "-m", "services.cli", "status"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert re.search(r"fallback: " + drafter + r"-\S+: draft suffix:gguf:smollm2-135m cannot run here: "
                         r"llama.cpp crashed with SIGSEGV in llama_decode .*; drafting with suffix instead",
                         status.stdout), \
            status.stdout
        assert re.search(r"processes \(mirror-sd up\): .*verify-worker running", status.stdout), status.stdout
        assert ("draft-worker running" in status.stdout) == (drafter == "draft"), status.stdout
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert re.search(r'mirror_sd:draft_fallback\{draft="suffix:gguf:smollm2-135m",fault="SIGSEGV",'
                         r'serving="suffix",worker="' + drafter + r'-[^"]+"\} 1.0', metrics)
        dashboard_shows_the_fallback(port, drafter)
        said = log_path.read_text()
        said_it = re.findall(r"draft suffix:gguf:smollm2-135m cannot run here", said)
        assert len(said_it) == 2, said[-4000:]  # the worker, and up

        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= (4 if drafter == "draft" else 3)  # gateway, verify worker, telemetry, draft worker
        up.kill()  # kill -9 of the supervisor: no handler of its own runs
        up.wait(timeout=10)
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [child.cmdline() for child in alive]
    finally:
        if up.poll() is None:
            up.kill()
        for child in psutil.Process().children(recursive=True):
            if "services.cli" in " ".join(child.cmdline()):
                child.kill()
        client.flushdb()
