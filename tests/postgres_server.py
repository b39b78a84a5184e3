"""A real PostgreSQL server for the tests: a cluster made with initdb in a temporary folder,
started with pg_ctl on a loopback port, run by an unprivileged user (PostgreSQL refuses root),
stopped and removed at the end of the session."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

USER = "mergepipe"


def _bindir() -> Path:
    """Debian keeps the server's programs in /usr/lib/postgresql/<version>/bin, off PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise RuntimeError("PostgreSQL's initdb not found: install Debian's postgresql package (scripts/setup.sh does)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        self.bindir = _bindir()
        self.dir = Path(tempfile.mkdtemp(prefix="mergepipe-pg-"))
        self.port = _free_port()
        # As root, the server runs as `nobody`, which must own its folder.
        self._as = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        self.dir.chmod(0o755)
        if self._as:
            shutil.chown(self.dir, "nobody")
        self._run("initdb", "-D", str(self.dir / "data"), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync")
        self._run(
            "pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "-t", "300",
            "-o", f"-h 127.0.0.1 -p {self.port} -k {self.dir} -F -c max_connections=200", "start",
        )  # fmt: skip
        self._count = 0

    def _run(self, program: str, *args: str) -> None:
        subprocess.run([*self._as, str(self.bindir / program), *args], check=True, capture_output=True, cwd=self.dir)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        self._count += 1
        name = f"catalog_{self._count}"
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, name)
        return self.url(name)

    def psql(self, database: str, sql: str) -> str:
        out = subprocess.run(
            [str(self.bindir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, "-d", database,
             "-At", "-c", sql],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        return out.stdout

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
