"""Local paths and gs:// URLs: the one path layer of lambjax.

Every path lambjax reads or writes (workdir, data_dir, vocabulary, text globs, exports) goes
through etils `epath` on its fsspec backend, which serves gs:// with gcsfs. Why that layer:
Orbax and TFDS already do their directory work through epath, so one layer covers lambjax and
them; but epath hands gs:// to TensorFlow's gfile whenever TensorFlow is installed (it is, for
Google's TensorFlow checkpoints and TFDS's builds), and TensorFlow's GCS client has its
endpoints compiled in (`https://www.googleapis.com/storage/v1/`, no override; see `strings`
of libtensorflow_framework.so), so it can be pointed at no emulator. gcsfs is a maintained GCS
client that uses Google's default credentials and honours `STORAGE_EMULATOR_HOST`;
`EPATH_USE_TF=false` (set below, before any gs:// access) makes epath use it.

`STORAGE_EMULATOR_HOST=http://HOST:PORT`, the convention of Google's client libraries, is the
one switch that points every gs:// access at a local emulator; lambjax maps it to what each
library reads:
- gcsfs (epath: lambjax, TFDS, Orbax's directory operations): `STORAGE_EMULATOR_HOST` itself,
  and `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`: its bucket-type probe calls the Storage Control
  gRPC API, which emulators do not serve (a 60 s timeout per bucket otherwise);
- tensorstore (Orbax's arrays): `TENSORSTORE_GCS_HTTP_URL`, and
  `GOOGLE_AUTH_TOKEN_FOR_TESTING` (tensorstore's documented test token; emulators ignore it);
- google-cloud-cpp inside ArrayRecord (grain's reader of the datasets):
  `CLOUD_STORAGE_EMULATOR_ENDPOINT`;
- the TensorBoard event files and the profiler's traces read nothing: for a gs:// workdir
  they are written to a local folder that `Mirror` copies into the bucket.

Against a real bucket (no STORAGE_EMULATOR_HOST) gcsfs uses its default class,
`ExtendedGcsFileSystem`, which the emulator tests do not run: it first asks the Storage Control
API (gRPC, storage.googleapis.com:443) for each bucket's layout (GetStorageLayout, which needs
`storage.objects.list`, as in roles/storage.objectUser; refused, gcsfs warns and falls back
to plain object calls, asking again at each operation), and on a bucket with hierarchical
namespace it creates, renames and deletes folders through that API (the `storage.folders.*`
permissions). A flat bucket needs no more than object reads, writes, lists and deletes.

GCS has no atomic rename and no append. So nothing in lambjax relies on either: builds are
complete when their last file (a marker) exists, Orbax marks finished checkpoints on GCS with
`commit_success.txt`, and append-only logs are written locally and mirrored whole.
"""

import contextlib
import os
import shutil
import tempfile
import time

from absl import logging
from etils import epath


def configure_environment() -> None:
    """Sets what the libraries above read (before their first gs:// access; lambjax calls it
    on import, and again where STORAGE_EMULATOR_HOST is set later in a process)."""
    os.environ.setdefault("EPATH_USE_TF", "false")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
        os.environ.setdefault("CLOUD_STORAGE_EMULATOR_ENDPOINT", emulator)


configure_environment()


class StorageError(OSError):
    """A path that cannot be used; the message is one line for the user."""


def is_remote(path) -> bool:
    return "://" in os.fspath(path)


def resolve(path: str) -> str:
    """An absolute local path (Orbax needs one), or a URL such as gs://... unchanged."""
    return path if is_remote(path) else str(epath.Path(path).expanduser().resolve())


def reason(error: BaseException) -> str:
    """An OSError (or a client library's error) as one short line."""
    text = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return text.strip().splitlines()[0]


def check_reachable(path: str, flag: str) -> None:
    """Raises StorageError unless a gs:// `path` can be reached: credentials, then its bucket.

    Called before any data build or compilation, so that a typo in a bucket name or a VM
    without a service account ends the run in seconds, not at its first checkpoint.
    """
    if not path.startswith("gs://"):
        return
    bucket = path[len("gs://") :].split("/", 1)[0]
    if not bucket:
        raise StorageError(f"{flag}={path} names no bucket; give gs://BUCKET/PATH")
    if not os.environ.get("STORAGE_EMULATOR_HOST"):
        import google.auth  # gcsfs's default credentials: the same lookup

        try:
            google.auth.default()
        except Exception as error:  # noqa: BLE001 - DefaultCredentialsError and transport errors
            raise StorageError(
                f"{flag}={path}: no Google Cloud credentials ({reason(error)}); on a Cloud TPU "
                "VM they come from its service account, elsewhere run `gcloud auth "
                "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
            ) from error
    try:  # a listing (storage.objects.list), the permission a run needs anyway
        next(iter(epath.Path(f"gs://{bucket}").iterdir()), None)
    except FileNotFoundError as error:
        raise StorageError(
            f"{flag}={path}: bucket {bucket!r} does not exist (or is not visible)"
        ) from error
    except Exception as error:  # noqa: BLE001 - gcsfs raises OSError, HttpError, ValueError
        message = f"{flag}={path}: bucket {bucket!r} cannot be listed: {reason(error)}"
        raise StorageError(message) from error


def free_space(path) -> str:
    """How much room is left where `path` is, for a message: '1.2 MB free on /mnt/run'."""
    if is_remote(path):
        return "a bucket has no free-space limit; its quota or permissions may"
    folder = os.path.abspath(os.fspath(path))
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        free = shutil.disk_usage(folder).free
    except OSError as error:
        return f"the free space of {folder} is unknown ({reason(error)})"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if free >= scale:
            return f"{free / scale:.1f} {unit} free on {folder}"
    return f"{free} bytes free on {folder}"


def write_text(path, text: str) -> None:
    """Writes a file so that it is never seen half-written: on GCS an object upload is atomic
    (the object appears whole when the upload ends); on local disk, through a temporary file
    renamed over the target."""
    path = epath.Path(path)
    if is_remote(path):
        path.write_text(text)
        return
    temporary = path.parent / f"{path.name}.tmp"
    temporary.write_text(text)
    temporary.replace(path)


@contextlib.contextmanager
def local_folder(path: str):
    """Yields a local folder to write `path`'s files into, for writers that need local disk
    (safetensors, tokenizers): `path` itself if local, else a temporary folder that is copied
    to `path` when the block ends."""
    if not is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="lambjax-out-") as scratch:
        yield scratch
        copy_tree(scratch, path)


def copy_tree(source, destination) -> None:
    """Copies the files under `source` to `destination` (either may be gs://)."""
    source, destination = epath.Path(source), epath.Path(destination)
    for path in files_under(source):
        target = destination / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        path.copy(target, overwrite=True)


def files_under(folder: epath.Path) -> list[epath.Path]:
    """Every file below `folder`, sorted (epath has no recursive glob on gs://)."""
    files = []
    for path in sorted(folder.iterdir()):
        files.extend(files_under(path) if path.is_dir() else [path])
    return files


def local_copy(path: str, folder: str | None = None) -> str:
    """`path` itself if local, else a copy of it (a file or a folder) in the local `folder`
    (default: a temporary folder of this process), for libraries that open local files only
    (tokenizers, safetensors, transformers)."""
    if not is_remote(path):
        return path
    folder = folder or tempfile.mkdtemp(prefix="lambjax-copy-")
    source = epath.Path(path)
    target = epath.Path(folder) / source.name
    if source.is_dir():
        copy_tree(source, target)
    else:
        source.copy(target, overwrite=True)
    return os.fspath(target)


def move_tree(source, destination) -> None:
    """Moves the folder `source` to `destination`: a rename on local disk; on GCS, which has
    no rename, a copy of every file, then the deletion of the source (an interruption leaves
    the source whole)."""
    source, destination = epath.Path(source), epath.Path(destination)
    if not is_remote(source):
        destination.parent.mkdir(parents=True, exist_ok=True)
        source.rename(destination)
        return
    copy_tree(source, destination)
    source.rmtree()


class Mirror:
    """A local folder whose files are copied into `remote` (gs://) by `sync`.

    For writers that need a local file system or append to their files (TensorBoard's event
    files, the profiler, metrics.jsonl): a GCS object cannot be appended to, so a changed file
    is uploaded whole. Files that already exist in `remote` and should be continued (the
    metrics.jsonl of a resumed run) are first fetched with `fetch`.
    """

    def __init__(self, remote: str, interval_s: float = 30.0):
        self.remote = epath.Path(remote)
        self.local = epath.Path(tempfile.mkdtemp(prefix="lambjax-mirror-"))
        self.interval_s = interval_s
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._last_sync = time.monotonic()

    def fetch(self, name: str) -> None:
        """Copies `remote/name` into the local folder, if it exists there."""
        source = self.remote / name
        if source.exists():
            target = self.local / name
            target.parent.mkdir(parents=True, exist_ok=True)
            source.copy(target, overwrite=True)
            self._uploaded[name] = _signature(target)

    def sync(self, force: bool = True) -> bool:
        """Uploads the files that changed since the last sync (if `interval_s` has passed,
        or always when `force`); whether every changed file reached `remote`.

        A file that cannot be uploaded (the bucket keeps failing after gcsfs's retries) is
        named in one warning and uploaded again at the next sync: the training goes on, and
        the checkpoint save that follows a forced sync meets the same bucket."""
        if not force and time.monotonic() - self._last_sync < self.interval_s:
            return True
        self._last_sync = time.monotonic()
        failed = []
        for path in files_under(self.local):
            name = os.fspath(path.relative_to(self.local))
            signature = _signature(path)
            if self._uploaded.get(name) == signature:
                continue
            target = self.remote / name
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                path.copy(target, overwrite=True)
            except Exception as error:  # noqa: BLE001 - gcsfs raises OSError, HttpError, ...
                failed.append(f"{name} ({reason(error)})")
                continue
            self._uploaded[name] = signature
        if failed:
            logging.warning(
                "Could not copy %s to %s; trying again at the next sync.",
                ", ".join(failed),
                self.remote,
            )
        return not failed

    def remove_local(self) -> None:
        """Deletes the local folder (after a last `sync`), unless files in it never reached
        the bucket: then it is kept, and named."""
        if not self.sync():
            logging.warning("The files above stay in %s.", self.local)
            return
        shutil.rmtree(self.local, ignore_errors=True)


def _signature(path: epath.Path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns
