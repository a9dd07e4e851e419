"""Finishing an answer whose worker died, against the real llama-server.

Started by continuation.sh: one llama-server (Gemma 3 270M, jinja template: a trailing
assistant message is a prefill only with one), the relay, and two workers on it. Each
run streams the same chat at temperature 0 with `X-Continue-On-Failure: true`, kills
the worker serving it (`kill -9`) after a random number of words, and reads the rest.

Asserted on every run (exit 1 otherwise): one well-formed stream (every event JSON, one
id, one role chunk, exactly one `: continued on another worker` comment, `[DONE]`
last) whose text begins with the text delivered before the kill. Printed: how often the
continued answer equals the uninterrupted one character for character.

API=messages streams `/v1/messages` through the real `anthropic` client instead, and
asserts one well-formed Anthropic stream as the client parsed it: one `message_start`,
one text block whose deltas all carry its index, one `message_delta`, `message_stop`
last (the client skips SSE comments: the marker is the Rust suites' to check).
"""
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time

RELAY = os.environ["RELAY"]  # host:port
LOGS = os.environ["LOGS"]
RUNS = int(os.environ.get("RUNS", "20"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "64"))
SEED = int(os.environ.get("SEED", str(int(time.time()))))
WORKER_ENV = json.loads(os.environ["WORKER_ENV"])  # common environment of the workers
WORKER_BIN = os.environ["WORKER_BIN"]
API = os.environ.get("API", "chat")  # or "messages"

BODY = {
    "model": "gemma3",
    "stream": True,
    "temperature": 0,
    "max_tokens": MAX_TOKENS,
    "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
}

workers = {}  # name -> Popen


def start_worker(name):
    env = dict(WORKER_ENV, WORKER_NAME=name, PATH=os.environ.get("PATH", ""))
    log = open(f"{LOGS}/worker-{name}.log", "a")
    workers[name] = subprocess.Popen([WORKER_BIN], env=env, stdout=log, stderr=log)


def workers_connected():
    c = http.client.HTTPConnection(RELAY, timeout=10)
    c.request("GET", "/health")
    n = json.loads(c.getresponse().read())["workers_connected"]
    c.close()
    return n


def wait_workers(n):
    deadline = time.time() + 30
    while workers_connected() != n:
        if time.time() > deadline:
            sys.exit(f"expected {n} workers")
        time.sleep(0.05)


def open_stream(continue_on_failure):
    c = http.client.HTTPConnection(RELAY, timeout=120)
    headers = {"content-type": "application/json"}
    if continue_on_failure:
        headers["x-continue-on-failure"] = "true"
    c.request("POST", "/v1/chat/completions", json.dumps(BODY), headers)
    r = c.getresponse()
    assert r.status == 200, r.status
    return c, r


def events(r):
    """Yields ('comment', text) and ('data', text) per SSE event until the body ends."""
    data = []
    while True:
        line = r.readline()
        if not line:
            return
        line = line.decode().rstrip("\r\n")
        if line == "":
            if data:
                yield ("data", "\n".join(data))
                data = []
        elif line.startswith(":"):
            yield ("comment", line)
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))


def content_of(data):
    chunk = json.loads(data)
    choices = chunk.get("choices") or [{}]
    return chunk, (choices[0].get("delta") or {}).get("content") or ""


def uninterrupted():
    c, r = open_stream(False)
    text = "".join(content_of(d)[1] for kind, d in events(r) if kind == "data" and d != "[DONE]")
    c.close()
    return text


def serving_worker(request_id):
    """The worker whose log says it forwarded `request_id`."""
    deadline = time.time() + 10
    while time.time() < deadline:
        for name in workers:
            with open(f"{LOGS}/worker-{name}.log", errors="replace") as f:
                if f"forwarding request {request_id}" in f.read():
                    return name
        time.sleep(0.01)
    sys.exit(f"no worker logged {request_id}")


def kill_serving(request_id):
    killed = serving_worker(request_id)
    workers[killed].send_signal(signal.SIGKILL)
    workers[killed].wait()
    return killed


def run(k, expected):
    c, r = open_stream(True)
    request_id = r.getheader("x-request-id")
    ids, created, roles, markers, texts, done_last = set(), set(), 0, 0, [], False
    before, killed = None, None
    words = 0
    for kind, data in events(r):
        if kind == "comment":
            markers += data == ": continued on another worker"
            continue
        done_last = data == "[DONE]"
        if done_last:
            continue
        chunk, text = content_of(data)  # raises on a malformed event
        ids.add(chunk.get("id"))
        created.add(chunk.get("created"))
        roles += "role" in ((chunk.get("choices") or [{}])[0].get("delta") or {})
        texts.append(text)
        words += bool(text)
        if killed is None and words == k:
            before = "".join(texts)
            killed = kill_serving(request_id)
    c.close()
    final = "".join(texts)
    problems = []
    # (llama-server's own `created` changes from chunk to chunk: only the id is one.)
    if len(ids) != 1:
        problems.append(f"ids {ids}")
    if roles != 1:
        problems.append(f"{roles} role chunks")
    if markers != 1:
        problems.append(f"{markers} markers")
    if not done_last:
        problems.append("[DONE] is not last")
    return finish(problems, killed, final, before, expected)


def finish(problems, killed, final, before, expected):
    if killed is None:
        problems.append("the answer ended before the kill")
    if before is not None and not final.startswith(before):
        problems.append("the prefix is not intact")
    if killed is not None:
        start_worker(killed)
        wait_workers(2)
    return final == expected, problems, final, before


def anthropic_stream(continue_on_failure):
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://{RELAY}", api_key="unused", max_retries=0)
    headers = {"x-continue-on-failure": "true"} if continue_on_failure else {}
    return client.messages.create(
        model=BODY["model"], max_tokens=MAX_TOKENS, stream=True, messages=BODY["messages"],
        extra_body={"temperature": 0}, extra_headers=headers)


def uninterrupted_messages():
    return "".join(e.delta.text for e in anthropic_stream(False)
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")


def run_messages(k, expected):
    stream = anthropic_stream(True)
    request_id = stream.response.headers.get("x-request-id")
    kinds, indexes, texts, before, killed = [], set(), [], None, None
    for event in stream:  # the client parses the events; a malformed one raises
        kinds.append(event.type)
        if getattr(event, "index", None) is not None:
            indexes.add(event.index)
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            texts.append(event.delta.text)
            if killed is None and len(texts) == k:
                before = "".join(texts)
                killed = kill_serving(request_id)
    problems = []
    for kind in ("message_start", "content_block_start", "content_block_stop",
                 "message_delta", "message_stop"):
        if kinds.count(kind) != 1:
            problems.append(f"{kinds.count(kind)} {kind}")
    if indexes != {0}:
        problems.append(f"block indexes {indexes}")
    if kinds and kinds[-1] != "message_stop":
        problems.append(f"{kinds[-1]} is last")
    return finish(problems, killed, "".join(texts), before, expected)


def main():
    for name in ("a", "b"):
        start_worker(name)
    wait_workers(2)
    expected = uninterrupted_messages() if API == "messages" else uninterrupted()
    words = len(expected.split())
    rng = random.Random(SEED)
    same, bad = 0, 0
    print(f"{API}: continuation vs uninterrupted, {RUNS} runs, SEED={SEED}, {MAX_TOKENS} tokens")
    for i in range(RUNS):
        k = rng.randint(1, max(1, min(words, MAX_TOKENS) - 8))
        equal, problems, final, before = (run_messages if API == "messages" else run)(k, expected)
        same += equal
        bad += bool(problems)
        print(f"  run {i + 1:2}: killed after {k:2} words: {'same' if equal else 'differs'}"
              + (f"  PROBLEMS: {problems}" if problems else ""))
        if not equal:
            print(f"      before kill: {before!r}\n      continued:   {final!r}\n      expected:    {expected!r}")
    print(f"identical to the uninterrupted answer: {same}/{RUNS}")
    print(f"well-formed streams with the prefix intact: {RUNS - bad}/{RUNS}")
    for p in workers.values():
        p.kill()
    sys.exit(1 if bad else 0)


main()
