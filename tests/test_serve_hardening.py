"""The server against clients that should not get what they ask: web pages, slow clients, floods.

* a POST to ``/v1`` that does not say it is JSON (text/plain, a form, multipart, no type) is refused
  with 415 before anything is read or queued: a web page can send those anywhere without asking;
* a ``Host`` the server does not answer to (a DNS-rebinding page's name) gets 400, on every route;
* an ``Origin`` on a ``/v1`` request that is not allowed gets 403; allowed origins get CORS answers,
  preflights included, and a preflight needs no API key;
* a client that drips its headers has its connection closed after the header timeout; one that
  drips its body gets 408 after the body timeout; past the concurrency limit new requests get 503,
  and once the slow connections are closed the server answers again.

Shutdown with streams in flight is in ``test_serve.py`` (in-process and ``python -m kvpaging.entrypoints.serve``).
Everything here is on 127.0.0.1 and bounded in time.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from kvpaging import LLM
from kvpaging.models import tiny
from kvpaging.entrypoints.serve import BackgroundServer, _name_list, create_app, default_allowed_hosts

pytestmark = pytest.mark.usefixtures("one_thread")

BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}


def tiny_llm():
    return LLM(tiny("qwen3"), num_blocks=32, max_model_len=128)


@pytest.fixture(scope="module")
def server(one_thread):
    app = create_app(tiny_llm(), served_model_name="tiny", allowed_origins=["https://good.example"])
    with BackgroundServer(app, header_timeout_s=0.5, limit_concurrency=6, timeout_keep_alive=1) as s:
        yield s


def served(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvpaging:request_success_total"))


@pytest.mark.parametrize("headers, content", [
    ({"content-type": "text/plain"}, b'{"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}'),
    ({}, b'{"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}'),
    ({"content-type": "application/x-www-form-urlencoded"}, b"model=tiny&prompt=5"),
    ({"content-type": "multipart/form-data; boundary=x"}, b"--x\r\n\r\nhi\r\n--x--\r\n"),
    ({"content-type": "application/jsonp"}, b'{"model": "tiny"}'),
], ids=["text-plain", "none", "form", "multipart", "lookalike"])
def test_a_post_that_is_not_json_is_refused_before_anything_is_queued(server, headers, content):
    before, steps = served(server), server.llm.call(lambda e: e.num_steps)
    response = httpx.post(server.url + "/v1/completions", content=content, headers=headers)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert served(server) == before and server.llm.call(lambda e: e.num_steps) == steps


def test_json_with_a_charset_is_json(server):
    response = httpx.post(server.url + "/v1/completions", content=httpx.Request("POST", "/", json=BODY).content,
                          headers={"content-type": "application/json; charset=utf-8"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics"])
def test_a_host_the_server_does_not_answer_to_is_refused_on_every_route(server, path):
    assert httpx.get(server.url + path, headers={"host": "evil.example"}).status_code == 400
    assert httpx.get(server.url + path, headers={"host": f"evil.example:{server.port}"}).status_code == 400
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "localhost", f"[::1]:{server.port}"):
        assert httpx.get(server.url + path, headers={"host": host}).status_code == 200, host
    response = httpx.get(server.url + "/v1/models", headers={"host": "evil.example"})
    assert response.json()["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in response.text


def test_any_host_is_answered_when_asked_for(one_thread):
    with BackgroundServer(create_app(tiny_llm(), served_model_name="tiny", allowed_hosts=["*"])) as s:
        assert httpx.get(s.url + "/v1/models", headers={"host": "my-box.lan:8000"}).status_code == 200


def test_web_origins_not_allowed_are_refused_and_allowed_ones_get_cors(server):
    refused = httpx.post(server.url + "/v1/completions", json=BODY, headers={"origin": "https://evil.example"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in refused.headers
    ok = httpx.post(server.url + "/v1/completions", json=BODY, headers={"origin": "https://good.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://good.example"
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    good = httpx.options(server.url + "/v1/completions", headers={"origin": "https://good.example", **preflight})
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "https://good.example"
    evil = httpx.options(server.url + "/v1/completions", headers={"origin": "https://evil.example", **preflight})
    assert evil.status_code in (400, 403) and "access-control-allow-origin" not in evil.headers
    # no Origin (curl, the openai client): not a browser, nothing to refuse
    assert httpx.post(server.url + "/v1/completions", json=BODY).status_code == 200


def test_without_allowed_origins_a_page_cannot_even_preflight(one_thread):
    with BackgroundServer(create_app(tiny_llm(), served_model_name="tiny", api_key="k")) as s:
        response = httpx.options(s.url + "/v1/completions", headers={
            "origin": "https://evil.example", "access-control-request-method": "POST"})
        assert response.status_code in (401, 403, 405) and "access-control-allow-origin" not in response.headers
        answer = httpx.post(s.url + "/v1/completions", json={**BODY, "model": "tiny"},
                            headers={"origin": "https://evil.example", "authorization": "Bearer k"})
        assert answer.status_code == 403


def test_a_cors_preflight_needs_no_api_key_but_the_request_does(one_thread):
    app = create_app(tiny_llm(), served_model_name="tiny", api_key="k", allowed_origins=["https://good.example"])
    with BackgroundServer(app) as s:
        preflight = httpx.options(s.url + "/v1/completions", headers={
            "origin": "https://good.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert httpx.post(s.url + "/v1/completions", json=BODY,
                          headers={"origin": "https://good.example"}).status_code == 401
        assert httpx.post(s.url + "/v1/completions", json=BODY, headers={
            "origin": "https://good.example", "authorization": "Bearer k"}).status_code == 200


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closes ``sock`` (None if still open after ``seconds``)."""
    start = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - start < seconds:
        try:
            data = sock.recv(4096)
        except socket.timeout:
            continue
        except ConnectionError:
            return time.monotonic() - start
        if data == b"":
            return time.monotonic() - start
    return None


def test_dripping_headers_are_cut_off_and_dripping_bodies_get_408(one_thread):
    app = create_app(tiny_llm(), served_model_name="tiny", body_timeout_s=0.5)
    with BackgroundServer(app, header_timeout_s=0.5) as s:
        # headers sent a piece at a time, never finished
        with socket.create_connection((s.host, s.port)) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            elapsed = closed_within(slow, 5)
            assert elapsed is not None and 0.3 < elapsed < 3, elapsed
        # a connection that says nothing at all
        with socket.create_connection((s.host, s.port)) as silent:
            assert closed_within(silent, 5) is not None
        # headers in full, then a body that stops half way
        with socket.create_connection((s.host, s.port)) as drip:
            drip.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"model\": ")
            drip.settimeout(5)
            answer = b""
            while chunk := drip.recv(4096):  # the server closes the connection after its answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b"did not arrive within 0.5 s" in answer
        # a keep-alive client between two requests is not cut off by the header timer
        with httpx.Client(base_url=s.url) as keep:
            assert keep.post("/v1/completions", json=BODY).status_code == 200
            time.sleep(0.2)
            assert keep.post("/v1/completions", json=BODY).status_code == 200
        assert s.llm.call(lambda e: e.get_num_unfinished_requests()) == 0


def test_past_the_concurrency_limit_new_requests_get_503_until_slow_connections_are_closed(server):
    hogs = [socket.create_connection((server.host, server.port)) for _ in range(6)]
    try:
        time.sleep(0.1)
        response = httpx.get(server.url + "/v1/models")
        assert response.status_code == 503, response.text
    finally:
        pass
    # the header timeout closes the silent ones; then the server answers again
    deadline = time.monotonic() + 5
    while httpx.get(server.url + "/v1/models").status_code != 200:
        assert time.monotonic() < deadline, "the slow connections were never closed"
        time.sleep(0.1)
    assert all(closed_within(h, 0.5) is not None for h in hogs)
    for h in hogs:
        h.close()


def test_list_flags_take_commas_or_json_and_refuse_empty_names():
    assert _name_list("a.example,b.example") == ["a.example", "b.example"]
    assert _name_list('["https://x.example", "*"]') == ["https://x.example", "*"]
    for bad in ("", "a,,b", "[1]", "[not json"):
        with pytest.raises(Exception, match="empty name|JSON"):
            _name_list(bad)
    assert default_allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert default_allowed_hosts("0.0.0.0") is None
    with pytest.raises(ValueError, match="allowed_hosts"):
        create_app(tiny_llm(), allowed_hosts="localhost")


def test_the_server_takes_what_exists_at_start_out_of_the_collectors_sight(monkeypatch):
    """``kvpaging serve`` freezes the garbage collector's view once the model is loaded and before the first
    request: a full collection no longer walks the model's, the engine's and the libraries' objects, a pause that
    would land in some request's time to first token. (The app and the server are stand-ins here: nothing is
    loaded or served.)"""
    import gc

    from kvpaging.entrypoints import serve

    frozen_when_served = []

    class Server:
        def run(self):
            frozen_when_served.append(gc.get_freeze_count())

    monkeypatch.setattr(serve, "create_app", lambda *a, **k: object())
    monkeypatch.setattr(serve, "make_server", lambda *a, **k: Server())
    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)  # the test process keeps its own handlers
    monkeypatch.setattr(serve.logging, "basicConfig", lambda **k: None)
    gc.unfreeze()
    try:
        serve.run(serve.make_parser().parse_args(["some-model"]))
        assert frozen_when_served and frozen_when_served[0] > 1000
    finally:
        gc.unfreeze()
