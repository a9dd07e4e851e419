"""The routes beyond chat against a real llama-server, through the relay and directly.

Environment: RELAY (the modelrelay server URL), LLAMA (the llama-server its worker
forwards to), MODEL (the advertised model). Every route is called twice with the same
body, once through the relay and once on llama-server itself, and the two answers must
be the same, byte for byte: status, content type and body. Prints one line per test and
a final "real-backend endpoints: N passed, N failed" line.

What Gemma 3 270M on a llama-server without `--reranking` answers: `/tokenize`,
`/detokenize` and `/apply-template` work; `/infill` is refused (the model has no
fill-in-the-middle tokens) and `/v1/rerank` is refused (no `--reranking`). Those
refusals must reach the client as llama-server sent them; the routes themselves are
exercised on fake backends (tests/endpoints.rs).
"""

import json
import os
import sys
import traceback
import urllib.error
import urllib.request

RELAY = os.environ["RELAY"]
LLAMA = os.environ["LLAMA"]
MODEL = os.environ.get("MODEL", "gemma3")
HANG = 600


def post(base, path, body):
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        base + path, data=data, headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=HANG) as r:
            return r.status, r.headers.get("content-type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type"), e.read()


def same(path, body, volatile=()):
    """The relay's answer equals llama-server's own; returns it. `volatile`: top-level
    JSON fields of a successful answer that differ between any two calls (timings)."""
    relayed = post(RELAY, path, body)
    direct = post(LLAMA, path, body)
    if volatile and relayed[0] == direct[0] == 200:
        strip = lambda raw: {k: v for k, v in json.loads(raw).items() if k not in volatile}
        assert relayed[:2] == direct[:2] and strip(relayed[2]) == strip(direct[2]), (relayed, direct)
        return relayed
    assert relayed == direct, f"{path}: relay {relayed!r} != direct {direct!r}"
    return relayed


def test_tokenize_detokenize_round_trip():
    status, ctype, body = same(
        "/tokenize", {"model": MODEL, "content": "Hello, relay! ünïcödé", "with_pieces": True}
    )
    assert status == 200 and ctype.startswith("application/json"), (status, ctype)
    tokens = [t["id"] for t in json.loads(body)["tokens"]]
    assert tokens, body
    status, _, body = same("/detokenize", {"model": MODEL, "tokens": tokens})
    assert status == 200, body
    assert "Hello, relay!" in json.loads(body)["content"], body


def test_apply_template():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three colors."},
    ]
    status, _, body = same("/apply-template", {"model": MODEL, "messages": messages})
    assert status == 200, body
    assert "Name three colors." in json.loads(body)["prompt"], body


def test_infill_answer_passes_through():
    status, _, body = same(
        "/infill",
        {"model": MODEL, "input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 4,
         "temperature": 0, "cache_prompt": False},
        volatile=("timings",),
    )
    # Gemma 3 270M has no FIM tokens: llama-server refuses, and so does the relay.
    print(f"    /infill: llama-server answered {status}", flush=True)


def test_rerank_answer_passes_through():
    status, _, body = same(
        "/v1/rerank", {"model": MODEL, "query": "colour", "documents": ["red", "car"]}
    )
    print(f"    /v1/rerank: llama-server answered {status}", flush=True)


def main():
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_")]
    failed = 0
    for name, fn in tests:
        try:
            fn()
            print(f"ok   {name}", flush=True)
        except Exception:  # noqa: BLE001 - report every failure, run the rest
            failed += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
    print(f"real-backend endpoints: {len(tests) - failed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
