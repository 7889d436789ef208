"""A fake GCE metadata server for one worker of a Cloud TPU VM slice, served on 127.0.0.1.

Simulated:
- From Compute Engine's metadata documentation ("About VM metadata", "Query VM metadata",
  https://cloud.google.com/compute/docs/metadata/overview): instance attributes are read
  with GET http://metadata.google.internal/computeMetadata/v1/instance/attributes/<key>;
  a request without the header `Metadata-Flavor: Google` is refused with 403, a key that is
  not set answers 404, and responses carry `Metadata-Flavor: Google`.
- From JAX's Cloud TPU detection (jax/_src/clusters/cloud_tpu_cluster.py): the server's
  address may be given as GCE_METADATA_IP; the attributes a TPU VM worker has are
  `agent-worker-number` (this worker's index), `worker-network-endpoints` (comma-separated
  workers, each `name:id:ip` in the older format that JAX still parses, or a bare address)
  and `tpu-env` (lines of `KEY: 'value'`, e.g. MEGASCALE_NUM_SLICES for multislice).
"""

import http.server
import threading


class MetadataServer:
    """Serves `attributes` (key -> text) until `close()`; `address` is host:port."""

    def __init__(self, attributes: dict[str, str]):
        self.attributes = attributes
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                prefix = "/computeMetadata/v1/instance/attributes/"
                key = self.path[len(prefix) :] if self.path.startswith(prefix) else None
                if self.headers.get("Metadata-Flavor") != "Google":
                    self.answer(403, "Missing required header: Metadata-Flavor")
                elif key not in server.attributes:
                    self.answer(404, "Not found")
                else:
                    self.answer(200, server.attributes[key])

            def answer(self, code: int, text: str):
                body = text.encode()
                self.send_response(code)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()


def tpu_vm_worker(worker: int, addresses: list[str]) -> dict[str, str]:
    """The TPU attributes of worker `worker` of a slice whose workers have `addresses`."""
    endpoints = ",".join(f"t1v-n-0-w-{i}:{i}:{ip}" for i, ip in enumerate(addresses))
    return {
        "agent-worker-number": str(worker),
        "worker-network-endpoints": endpoints,
        "tpu-env": f"WORKER_ID: '{worker}'\nACCELERATOR_TYPE: 'v5p-32'\n",
    }
