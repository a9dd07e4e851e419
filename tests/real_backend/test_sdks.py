"""Real clients against the relay in front of a real llama-server.

Environment: RELAY (the modelrelay server URL), LLAMA (llama-server URL, for /slots),
MODEL (the advertised model). Prints one line per test and a final
"real-backend: N passed, N failed" line.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

import anthropic
import openai

RELAY = os.environ["RELAY"]
LLAMA = os.environ["LLAMA"]
MODEL = os.environ.get("MODEL", "gemma3")
PROMPT = [{"role": "user", "content": "Name three colors."}]

oa = openai.OpenAI(base_url=RELAY + "/v1", api_key="unused", max_retries=0, timeout=60)
an = anthropic.Anthropic(base_url=RELAY, api_key="unused", max_retries=0, timeout=60)


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def wait_for(what, pred, limit=60.0, step=0.02):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError("timed out waiting for " + what)


def test_models_lists_the_backend_model():
    wait_for("the worker to register", lambda: get_json(RELAY + "/health")["workers_connected"] == 1)
    wait_for("the model to be advertised", lambda: any(m.id == MODEL for m in oa.models.list().data))


def test_chat_plain_is_deterministic():
    a = oa.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12, temperature=0)
    b = oa.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12, temperature=0)
    text = a.choices[0].message.content
    assert text, a
    assert text == b.choices[0].message.content, (text, b.choices[0].message.content)
    assert a.usage is None or a.usage.completion_tokens > 0


def test_chat_streaming():
    stream = oa.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces).strip(), pieces
    assert len(pieces) > 1, "streamed in several chunks"


def test_responses():
    r = oa.responses.create(model=MODEL, input="Name three colors.", max_output_tokens=12, temperature=0)
    assert r.output_text.strip(), r


def test_messages_plain():
    m = an.messages.create(model=MODEL, max_tokens=12, messages=PROMPT, extra_body={"temperature": 0})
    assert m.content and m.content[0].text.strip(), m


def test_messages_streaming():
    with an.messages.stream(model=MODEL, max_tokens=12, messages=PROMPT, extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
    assert text.strip(), text


def test_curl_plain_and_streaming():
    body = json.dumps({"model": MODEL, "messages": PROMPT, "max_tokens": 8, "temperature": 0})
    out = subprocess.run(["curl", "-sf", RELAY + "/v1/chat/completions", "-H", "content-type: application/json", "-d", body],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["choices"][0]["message"]["content"]
    body = json.dumps({"model": MODEL, "messages": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sfN", RELAY + "/v1/chat/completions", "-H", "content-type: application/json", "-d", body],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("data: ") > 2 and "[DONE]" in out, out


def busy_slots():
    return sum(1 for s in get_json(LLAMA + "/slots") if s.get("is_processing"))


def open_stream(max_tokens):
    """Starts a streaming request on a raw socket; returns it after the first chunk."""
    host, port = RELAY.split("//")[1].split(":")
    body = json.dumps({"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    s = socket.create_connection((host, int(port)))
    s.sendall(("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               "content-length: %d\r\n\r\n%s" % (len(body), body)).encode())
    first = s.recv(4096)
    assert b" 200 " in first.split(b"\r\n")[0], first[:200]
    return s


def test_client_disconnect_frees_the_llama_slot_within_1s():
    wait_for("idle slots", lambda: busy_slots() == 0)
    s = open_stream(400)
    assert busy_slots() >= 1
    s.close()
    t0 = time.monotonic()
    wait_for("the slot to go idle", lambda: busy_slots() == 0, limit=5)
    elapsed = time.monotonic() - t0
    print("    slot idle %.0f ms after the client hung up" % (elapsed * 1000))
    assert elapsed < 1.0, elapsed


def read_to_end(sock, results, i):
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        if b"\r\n0\r\n\r\n" in data[-16:]:
            break
    results[i] = (time.monotonic(), data)
    sock.close()


def test_four_streams_fill_four_slots_and_a_fifth_queues_then_completes():
    wait_for("idle slots", lambda: busy_slots() == 0)
    results = {}
    socks = [open_stream(96) for _ in range(4)]
    threads = [threading.Thread(target=read_to_end, args=(s, results, i)) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    fifth = {}

    def run_fifth():
        r = oa.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8, temperature=0)
        fifth["done"] = (time.monotonic(), r.choices[0].message.content)

    t5 = threading.Thread(target=run_fifth)
    t5.start()
    wait_for("the fifth request to queue", lambda: get_json(RELAY + "/health")["queue_depth"] == 1 or "done" in fifth, limit=10, step=0.005)
    queued = "done" not in fifth
    for t in threads + [t5]:
        t.join(60)
    assert len(results) == 4 and all(b"[DONE]" in d for _, d in results.values()), "four streams completed"
    assert fifth.get("done") and fifth["done"][1], "fifth completed"
    assert queued, "the fifth request waited in the relay queue"
    assert fifth["done"][0] >= min(t for t, _ in results.values()), "it ran after a slot freed"


def test_zz_unknown_model_is_a_404_in_the_sdk_error_shape():
    # Once the relay is older than its queue timeout (8 s here), a model nobody
    # advertised fails at once instead of waiting in the queue.
    wait_for("the relay to outlive its queue timeout", lambda: get_json(RELAY + "/health")["uptime_secs"] > 8.5, limit=30, step=0.1)
    try:
        oa.chat.completions.create(model="no-such-model-at-all", messages=PROMPT, max_tokens=4)
    except openai.NotFoundError as e:
        assert e.body and e.body.get("code") == "model_not_found", e.body
        assert MODEL in e.body.get("message", ""), e.body
    else:
        raise AssertionError("expected 404 model_not_found")


def main():
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    passed = failed = 0
    for name, fn in tests:
        t0 = time.monotonic()
        try:
            fn()
            passed += 1
            print("ok     %s (%.2fs)" % (name, time.monotonic() - t0))
        except Exception:
            failed += 1
            print("FAILED %s" % name)
            traceback.print_exc()
        sys.stdout.flush()
    print("real-backend: %d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
