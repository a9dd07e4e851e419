"""Issue 12 against a real llama-server in router mode (`--models-dir` holding the Gemma
file under two names, no autoload): capabilities, load and poll, a request to the loaded
model, cache flush (slot erase), unload — through a relay with the admin token — and a
load governed by an op token minted with `modelrelay-server sign-op-token`.

Imported by test_sdks.py, so its tests run and count in the same suite."""

import json
import os
import subprocess
import time
import urllib.error
import urllib.request

ROUTER_RELAY = os.environ.get("ROUTER_RELAY")
ROUTER_ADMIN = os.environ.get("ROUTER_ADMIN", "")
ROUTER_KEY = os.environ.get("ROUTER_KEY", "")
SERVER_BIN = os.environ.get("SERVER_BIN", "./target/release/modelrelay-server")
LIMIT = 300


def call(method, path, body=None, headers=None):
    """(status, JSON body) of one request to the router relay."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(ROUTER_RELAY + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=LIMIT) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def admin():
    return {"authorization": "Bearer " + ROUTER_ADMIN}


def router_runner():
    status, caps = call("GET", "/v1/capabilities?runner=router")
    return caps if status == 200 else None


def until(what, pred, limit=LIMIT):
    deadline = time.monotonic() + limit
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def poll_task(task_id):
    def done():
        status, t = call("GET", "/v1/models/load/" + task_id)
        assert status == 200, t
        return t if t["status"] not in ("loading", "unloading", "flushing") else None
    return until("task " + task_id, done)


def test_router_capabilities_load_route_flush_unload():
    if not ROUTER_RELAY:
        return
    caps = until("the router worker with its two models", lambda: (
        (c := router_runner()) and sorted(c["models"]["available"]) == ["gemma-a", "gemma-b"] and c))
    assert caps["runnerType"].startswith("llama-server"), caps["runnerType"]
    assert caps["lifecycle"] is True
    assert caps["models"]["loaded"] == [], caps["models"]

    status, task = call("POST", "/v1/models/load", {"modelId": "gemma-b"}, admin())
    assert status == 202, task
    done = poll_task(task["taskId"])
    assert done["status"] == "completed", done
    loaded = router_runner()["models"]["loaded"]
    assert [m["id"] for m in loaded] == ["gemma-b"], loaded
    # The worker asks the router for the loaded model's props (`/props?model=`): its
    # context is the router's -c 2048, once the worker's next pass read it.
    until("gemma-b's context length", lambda: (
        router_runner()["models"]["loaded"][0].get("contextLength") == 2048))

    status, answer = call("POST", "/v1/chat/completions", {
        "model": "gemma-b", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"], answer

    status, flushed = call("POST", "/v1/cache/flush", {"scope": "model", "modelId": "gemma-b"}, admin())
    assert status == 200, flushed
    assert flushed["runners"][0]["status"] == "completed", flushed

    status, unloaded = call("POST", "/v1/models/unload", {"modelId": "gemma-b"}, admin())
    assert status == 200, unloaded
    until("gemma-b unloaded", lambda: router_runner()["models"]["loaded"] == [])


def test_router_load_with_an_op_token_once():
    if not ROUTER_RELAY:
        return
    until("the router worker", router_runner)
    token = subprocess.run(
        [SERVER_BIN, "sign-op-token", "--operation", "load", "--model", "gemma-a",
         "--key-path", ROUTER_KEY, "--signer", "ops"],
        check=True, capture_output=True, text=True).stdout.strip()
    body = {"modelId": "gemma-a", "verifiedOpToken": token}
    status, task = call("POST", "/v1/models/load", body)
    assert status == 202, task
    assert poll_task(task["taskId"])["status"] == "completed"
    status, again = call("POST", "/v1/models/load", body)
    assert status == 401 and again["error"]["code"] == "op_token_replayed", again
    status, refused = call("POST", "/v1/models/unload", {"modelId": "gemma-a"})
    assert status == 401, refused
    status, _ = call("POST", "/v1/models/unload", {"modelId": "gemma-a"}, admin())
    assert status == 200
