"""The fault-injecting proxy of the storage tests (tests/fault_proxy.py) does what it says:
it passes requests through to the GCS emulator (an upload session's address rewritten to its
own), and answers a chosen share with 429 or 503, a reset connection or a stall."""

import http.client
import json
import os
import time

import pytest

from tests.fault_proxy import FaultProxy, uploads


@pytest.fixture(scope="module")
def proxy(gcs_bucket):
    proxy = FaultProxy(os.environ["STORAGE_EMULATOR_HOST"])
    yield proxy
    proxy.stop()


def request(proxy, method: str, path: str, body: bytes = b"", headers=None):
    host, port = proxy.url.split("//")[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_requests_pass_through_and_upload_sessions_come_back_to_the_proxy(proxy, gcs_bucket):
    bucket = gcs_bucket[len("gs://") :]
    proxy.inject(share=0.0)
    status, headers, _ = request(
        proxy,
        "POST",
        f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name=proxy/a.txt",
        b"{}",
        {"Content-Type": "application/json"},
    )
    assert status == 200
    assert headers["Location"].startswith(proxy.url)  # the session goes through the proxy
    session = headers["Location"][len(proxy.url) :]
    status, _, _ = request(proxy, "PUT", session, b"hello", {"Content-Length": "5"})
    assert status == 200
    status, _, body = request(proxy, "GET", f"/storage/v1/b/{bucket}/o/proxy%2Fa.txt")
    assert status == 200 and json.loads(body)["size"] == "5"
    assert proxy.url.encode() in body  # the object's links name the proxy


def test_each_kind_of_fault(proxy, gcs_bucket):
    bucket = gcs_bucket[len("gs://") :]
    listing = f"/storage/v1/b/{bucket}/o"
    for code in ("429", "503"):
        proxy.inject(share=1.0, kinds=(code,))
        status, _, body = request(proxy, "GET", listing)
        assert status == int(code) and json.loads(body)["error"]["code"] == int(code)
    proxy.inject(share=1.0, kinds=("reset",))
    with pytest.raises(ConnectionError):
        request(proxy, "GET", listing)
    proxy.inject(share=1.0, kinds=("stall",), stall_s=0.5)
    started = time.monotonic()
    status, _, _ = request(proxy, "GET", listing)
    assert status == 200 and time.monotonic() - started >= 0.5
    proxy.inject(share=1.0, kinds=("503",), match=uploads)  # reads pass, writes fail
    assert request(proxy, "GET", listing)[0] == 200
    proxy.inject(share=0.0)
    assert request(proxy, "GET", listing)[0] == 200
