"""Real clients against the relay in front of a real llama-server.

Environment: RELAY (the modelrelay server URL), LLAMA (llama-server URL, for /slots),
MODEL (the advertised model), RELAY_FAST404 (a second relay with a short queue timeout,
FAST404_QUEUE_TIMEOUT_SECS, and its own worker on the same llama-server). Prints one line
per test and a final "real-backend: N passed, N failed" line.

Tests decide by events (what /health or /slots shows, which response came back), never
by how fast this machine decodes: two busy cores can fall to a few tokens per second. The
main relay's queue timeout is far above any stream here, and every time limit below only
catches a hang.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

import anthropic
import ollama
import openai

RELAY = os.environ["RELAY"]
LLAMA = os.environ["LLAMA"]
MODEL = os.environ.get("MODEL", "gemma3")
RELAY_FAST404 = os.environ.get("RELAY_FAST404")
FAST404_QUEUE_TIMEOUT = float(os.environ.get("FAST404_QUEUE_TIMEOUT_SECS", "2"))
PROMPT = [{"role": "user", "content": "Name three colors."}]
# Only a hang takes this long (seconds): the limit on every wait, read and join.
HANG = 600

oa = openai.OpenAI(base_url=RELAY + "/v1", api_key="unused", max_retries=0, timeout=HANG)
an = anthropic.Anthropic(base_url=RELAY, api_key="unused", max_retries=0, timeout=HANG)
ol = ollama.Client(host=RELAY, timeout=HANG)
# A second llama-server started with --embeddings serves this model (for /api/embed).
EMBED_MODEL = os.environ.get("EMBED_MODEL", "gemma3-embed")


def get_json(url):
    with urllib.request.urlopen(url, timeout=HANG) as r:
        return json.load(r)


def wait_for(what, pred, limit=HANG, step=0.02):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError("timed out waiting for " + what)


def test_models_lists_the_backend_model():
    wait_for("the workers to register", lambda: get_json(RELAY + "/health")["workers_connected"] == 2)
    wait_for("the model to be advertised", lambda: any(m.id == MODEL for m in oa.models.list().data))
    wait_for("the embedding model too", lambda: any(m.id == EMBED_MODEL for m in oa.models.list().data))


def test_chat_plain_is_deterministic():
    # No prompt cache: the second request would evaluate only the last prompt token, in a
    # batch of another size, and llama.cpp does not promise bit-identical logits then.
    fresh = {"cache_prompt": False}
    a = oa.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12, temperature=0, extra_body=fresh)
    b = oa.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12, temperature=0, extra_body=fresh)
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


def health():
    return get_json(RELAY + "/health")


def open_stream(max_tokens, headers=()):
    """Starts a streaming request on a raw socket; returns it after the first chunk.
    ignore_eos: the stream lasts max_tokens whatever the model would say."""
    host, port = RELAY.split("//")[1].split(":")
    body = json.dumps({"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    s = socket.create_connection((host, int(port)), timeout=HANG)
    extra = "".join("%s: %s\r\n" % h for h in headers)
    s.sendall(("POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n%s"
               "content-length: %d\r\n\r\n%s" % (extra, len(body), body)).encode())
    first = s.recv(4096)
    assert b" 200 " in first.split(b"\r\n")[0], first[:200]
    return s


def read_events(sock, n):
    """Reads until n more SSE events arrived."""
    seen = 0
    while seen < n:
        chunk = sock.recv(65536)
        assert chunk, "stream ended early"
        seen += chunk.count(b"data: ")


def test_client_disconnect_frees_the_llama_slot_promptly():
    wait_for("idle slots", lambda: busy_slots() == 0)
    s = open_stream(1000)
    assert busy_slots() >= 1
    # This machine's pace right now, from the stream itself: the bound below is 1 s, or
    # 20 tokens' time where decoding is slower than 20 tokens a second. Left alone the
    # stream would run for 1000 tokens.
    t0 = time.monotonic()
    read_events(s, 5)
    per_token = (time.monotonic() - t0) / 5
    s.close()
    t0 = time.monotonic()
    wait_for("the slot to go idle", lambda: busy_slots() == 0, step=0.005)
    elapsed = time.monotonic() - t0
    bound = max(1.0, 20 * per_token)
    print("    slot idle %.0f ms after the client hung up (%.0f ms a token, bound %.1f s)"
          % (elapsed * 1000, per_token * 1000, bound))
    assert elapsed < bound, (elapsed, per_token)


def read_to_end(sock, results, i):
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        if b"\r\n0\r\n\r\n" in data[-16:]:
            break
    results[i] = data
    sock.close()


def start(fn, *args):
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def test_four_streams_fill_four_slots_and_a_fifth_queues_then_completes():
    wait_for("idle slots", lambda: busy_slots() == 0)
    results = {}
    socks = [open_stream(96) for _ in range(4)]
    threads = [start(read_to_end, s, results, i) for i, s in enumerate(socks)]
    fifth = {}

    def run_fifth():
        try:
            r = oa.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8, temperature=0)
            fifth["done"] = r.choices[0].message.content
        except Exception as e:
            fifth["done"] = None
            fifth["error"] = repr(e)

    t5 = start(run_fifth)
    # The relay's own account: the fifth waits in its queue while the four streams are
    # in flight (the queue timeout, 600 s, is far beyond the streams' length).
    seen = {}

    def fifth_queued_behind_four():
        seen.update(health())
        return (seen["queue_depth"] == 1 and seen["in_flight"] == 4) or "done" in fifth

    wait_for("the fifth request to queue behind the four streams", fifth_queued_behind_four, step=0.005)
    assert "done" not in fifth, ("the fifth request did not wait in the relay queue", seen)
    for t in threads + [t5]:
        t.join(HANG)
    assert len(results) == 4 and all(b"[DONE]" in d for d in results.values()), "four streams completed"
    assert fifth.get("done"), ("fifth completed", fifth)


def tenant_chat(tenant, out, order, lock):
    """One short chat request as `tenant`; records its status and when it finished."""
    body = json.dumps({"model": MODEL, "messages": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(RELAY + "/v1/chat/completions", data=body, method="POST",
                                 headers={"content-type": "application/json", "x-tenant-id": tenant})
    try:
        with urllib.request.urlopen(req, timeout=HANG) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = "%d %s" % (e.code, e.read()[:200])
    except Exception as e:
        status = repr(e)
    with lock:
        order.append(tenant)
        out.append((tenant, status))


def test_tenants_share_slots_fairly_a_flood_does_not_starve_a_calm_tenant():
    # Four long streams hold every llama slot, so the flood and then the calm tenant's
    # requests all wait in the relay queue in a known order; hanging up the holders
    # opens the four slots at once. Fair share must then serve calm's two requests
    # among the first, not behind all twelve of flood's.
    wait_for("idle slots", lambda: busy_slots() == 0)
    holders = [open_stream(1000) for _ in range(4)]
    wait_for("four busy slots", lambda: busy_slots() == 4)
    out, order, lock = [], [], threading.Lock()
    flood = [start(tenant_chat, "flood", out, order, lock) for _ in range(12)]
    wait_for("the flood to queue", lambda: health()["queue_depth"] == 12 or out, step=0.005)
    calm = [start(tenant_chat, "calm", out, order, lock) for _ in range(2)]
    wait_for("calm's requests to queue behind the flood", lambda: health()["queue_depth"] == 14 or out, step=0.005)
    assert not out, ("a request finished while every slot was held", out)
    for s in holders:
        s.close()
    for t in flood + calm:
        t.join(HANG)
    assert len(out) == 14, out
    assert all(status == 200 for _, status in out), out
    last_flood = max(i for i, t in enumerate(order) if t == "flood")
    calm_done = [i for i, t in enumerate(order) if t == "calm"]
    print("    completion order: " + " ".join(t[0] for t in order))
    assert max(calm_done) < last_flood, ("calm waited behind the whole flood", order)


def test_ollama_chat_plain():
    r = ol.chat(model=MODEL, messages=PROMPT, stream=False, options={"num_predict": 12, "temperature": 0})
    assert r.message.content.strip(), r
    assert r.done and r.eval_count and r.eval_count > 0, r
    assert r.prompt_eval_count and r.total_duration and r.total_duration > 0, r


def test_ollama_chat_streaming():
    parts = list(ol.chat(model=MODEL, messages=PROMPT, stream=True, options={"num_predict": 12, "temperature": 0}))
    text = "".join(p.message.content or "" for p in parts)
    assert text.strip() and len(parts) > 2, parts
    assert parts[-1].done and parts[-1].done_reason, parts[-1]
    assert sum(1 for p in parts if p.done) == 1


def test_ollama_generate():
    r = ol.generate(model=MODEL, prompt="Name three colors.", stream=False, options={"num_predict": 12, "temperature": 0})
    assert r.response.strip(), r


def test_ollama_embed():
    r = ol.embed(model=EMBED_MODEL, input=["red", "blue"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) > 10, r
    legacy = ol.embeddings(model=EMBED_MODEL, prompt="red")
    assert len(legacy.embedding) == len(r.embeddings[0])


def test_ollama_tags_ps_show():
    names = [m.model for m in ol.list().models]
    assert MODEL in names and EMBED_MODEL in names, names
    # The worker recognised llama-server and reports its one model as loaded.
    running = [m.model for m in ol.ps().models]
    assert MODEL in running and all(n in names for n in running), running
    shown = ol.show(MODEL)
    assert "completion" in (shown.capabilities or []), shown
    # The worker read llama-server's context size from /props.
    ctx = [v for k, v in (shown.modelinfo or {}).items() if k.endswith(".context_length")]
    assert ctx and ctx[0] > 0, shown


def test_ollama_disconnect_frees_the_slot():
    wait_for("idle slots", lambda: busy_slots() == 0)
    stream = ol.chat(model=MODEL, messages=PROMPT, stream=True, options={"num_predict": 1000, "temperature": 0})
    t0 = time.monotonic()
    for _ in range(5):
        next(stream)
    per_token = (time.monotonic() - t0) / 5
    assert busy_slots() >= 1
    stream.close()
    t0 = time.monotonic()
    wait_for("the slot to go idle", lambda: busy_slots() == 0, step=0.005)
    elapsed = time.monotonic() - t0
    bound = max(1.0, 20 * per_token)
    print("    slot idle %.0f ms after the Ollama client closed its stream (bound %.1f s)" % (elapsed * 1000, bound))
    assert elapsed < bound, (elapsed, per_token)


def post_json(url, body, headers=()):
    """POSTs a JSON body; returns (status, headers, parsed answer), errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers=dict([("content-type", "application/json")] + list(headers)))
    try:
        with urllib.request.urlopen(req, timeout=HANG) as r:
            return r.status, r.headers, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def conversation(text, turns):
    msgs = [{"role": "system", "content": "Answer in one word."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": "%d: %s" % (i, text)})
        msgs.append({"role": "assistant", "content": "%d: %s" % (i, text)})
    return msgs + [{"role": "user", "content": "Name one color."}]


def check_trimmed(body):
    """The relay answers `body` (too long for a llama slot) trimmed; with X-Context-Trim:
    off, llama-server's own 400 arrives unchanged. Returns (dropped, prompt tokens)."""
    status, direct_headers, direct = post_json(LLAMA + "/v1/chat/completions", body)
    assert status == 400 and direct["error"]["type"] == "exceed_context_size_error", (status, direct)
    n_ctx = direct["error"]["n_ctx"]
    raw = oa.chat.completions.with_raw_response.create(**body)
    dropped = int(raw.headers.get("x-context-trimmed", "-1"))
    r = raw.parse()
    assert dropped > 0, raw.headers
    assert r.choices[0].message.content is not None, r
    assert r.usage.prompt_tokens < n_ctx, (r.usage, n_ctx)
    status, _, off = post_json(RELAY + "/v1/chat/completions", body, [("X-Context-Trim", "off")])
    assert status == 400 and off == direct, (status, off, direct)
    print("    %d of %d messages dropped: %d prompt tokens of %d (untrimmed: %d)"
          % (dropped, len(body["messages"]), r.usage.prompt_tokens, n_ctx, direct["error"]["n_prompt_tokens"]))
    return dropped


def test_a_conversation_beyond_the_context_is_pre_trimmed():
    # Each llama slot holds 1,024 tokens (-c 4096 over -np 4), which the worker read from
    # /props: about 3,200 tokens of English are trimmed before they are sent.
    body = {"model": MODEL, "messages": conversation("word " * 100, 15), "max_tokens": 8, "temperature": 0}
    check_trimmed(body)


def test_a_prompt_denser_than_estimated_is_refused_then_trimmed():
    # Digits make a token each for Gemma: the worker's uncalibrated estimate (3 bytes a
    # token) says this fits, llama-server refuses it, and the worker retries trimmed with
    # the backend's own count.
    digits = " ".join(str(1000 + 7 * i) for i in range(40))
    body = {"model": MODEL, "messages": conversation(digits, 5), "max_tokens": 8, "temperature": 0}
    assert len(json.dumps(body)) / 3 < 1024 - 8, "the estimate must say it fits"
    check_trimmed(body)


def test_zz_unknown_model_is_a_404_in_the_sdk_error_shape():
    # A model nobody advertised fails at once once the relay is older than its queue
    # timeout: that takes the second relay (2 s), not the main one (600 s).
    assert RELAY_FAST404, "RELAY_FAST404 not set (tests/real_backend/run.sh starts it)"
    fast = openai.OpenAI(base_url=RELAY_FAST404 + "/v1", api_key="unused", max_retries=0, timeout=HANG)
    wait_for("the model to be advertised on the second relay", lambda: any(m.id == MODEL for m in fast.models.list().data))
    wait_for("the second relay to outlive its queue timeout",
             lambda: get_json(RELAY_FAST404 + "/health")["uptime_secs"] > FAST404_QUEUE_TIMEOUT + 0.5, step=0.1)
    try:
        fast.chat.completions.create(model="no-such-model-at-all", messages=PROMPT, max_tokens=4)
    except openai.NotFoundError as e:
        assert e.body and e.body.get("code") == "model_not_found", e.body
        assert MODEL in e.body.get("message", ""), e.body
    else:
        raise AssertionError("expected 404 model_not_found")


from lifecycle_tests import *  # noqa: E402,F401,F403 (router-mode lifecycle tests)


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
