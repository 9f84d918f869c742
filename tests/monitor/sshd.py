"""A real OpenSSH server on 127.0.0.1 for the SSH tests: its own host key, a user key made for
it, a known_hosts and an ssh_config naming it, and an nvidia-smi script on one port's PATH.

sshd listens on three ports: on ``port`` the session's PATH starts with a folder holding an
executable `nvidia-smi` (a script printing rows in nvidia-smi's CSV query format, for two
H100s); on ``old_port`` the same script as an older driver's, which knows the clock event
reasons by their pre-R535 name only; on ``bare_port`` the PATH has no nvidia-smi at all."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

# nvidia-smi's own format (nvidia-smi(1), --query-gpu with --format=csv,noheader,nounits):
# the fields in the order asked, ", " between them, no units; [N/A] where a GPU reports nothing.
NVIDIA_SMI = '''#!{python}
"""nvidia-smi --query-gpu=... --format=csv,noheader,nounits [-lms N], for two H100 80GB HBM3."""
import itertools, sys, time

args = sys.argv[1:]
query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
if query is None or "--format=csv,noheader,nounits" not in args:
    print("servescope's test nvidia-smi answers only --query-gpu=... "
          "--format=csv,noheader,nounits")
    sys.exit(2)
VALUES = {{
    "index": ("0", "1"),
    "utilization.gpu": ("{{t}}", "97"),
    "utilization.memory": ("23", "61"),
    "memory.used": ("4301", "80512"),
    "memory.total": ("81559", "81559"),
    "power.draw": ("112.47", "[N/A]"),
    "enforced.power.limit": ("700.00", "700.00"),
    "temperature.gpu": ("41", "67"),
    "clocks.sm": ("1980", "1755"),
    "clocks.mem": ("2619", "2619"),
    "clocks_event_reasons.active": ("0x0000000000000000", "0x0000000000000004"),
    "clocks_throttle_reasons.active": ("0x0000000000000000", "0x0000000000000004"),
    "ecc.errors.corrected.volatile.total": ("0", "{{t}}"),
}}
if {old_driver}:  # before R535 the clock event reasons were "throttle reasons" only
    del VALUES["clocks_event_reasons.active"]
fields = query.split(",")
for f in fields:
    if f not in VALUES:
        print(f'Field "{{f}}" is not a valid field to query.')
        sys.exit(2)
lms = int(args[args.index("-lms") + 1]) if "-lms" in args else None
for t in itertools.count():
    for gpu in (0, 1):
        print(", ".join(VALUES[f][gpu].format(t=t % 101) for f in fields), flush=True)
    if lms is None:
        break
    time.sleep(lms / 1000)
'''


class SshdUnavailable(Exception):
    """sshd could not be started here; the message says why."""


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports. Each socket stays bound until all are chosen: ports picked one
    after another, each released at once, can come back equal, and sshd with the "old" port
    equal to the "bare" one served the old-driver test a PATH without nvidia-smi (seen once in
    CI: ('up', 'no_nvidia_smi'))."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def keygen(path: Path) -> list[str]:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "servescope-test",
                    "-f", str(path)], check=True, capture_output=True)
    return path.with_suffix(".pub").read_text().split()[0:2]


class Sshd:
    """sshd -D on 127.0.0.1 (two ports), with everything a client needs to reach it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.user = getpass.getuser()
        self.port, self.bare_port, self.old_port = free_ports(3)
        self.host_key = root / "host_ed25519"
        self.user_key = root / "user_ed25519"
        self.other_key = root / "other_ed25519"
        host_pub = keygen(self.host_key)
        (root / "authorized_keys").write_text(" ".join(keygen(self.user_key)) + "\n")
        keygen(self.other_key)
        bin_dir, old_bin, empty = root / "bin", root / "old-bin", root / "empty"
        empty.mkdir()
        for folder, old in ((bin_dir, False), (old_bin, True)):
            folder.mkdir()
            smi = folder / "nvidia-smi"
            smi.write_text(NVIDIA_SMI.format(python=sys.executable, old_driver=old))
            smi.chmod(0o755)
        system = ":".join(d for d in ("/usr/bin", "/bin") if not Path(d, "nvidia-smi").exists())
        self.config = root / "sshd_config"
        self.config.write_text(textwrap.dedent(f"""\
            ListenAddress 127.0.0.1
            Port {self.port}
            Port {self.bare_port}
            Port {self.old_port}
            HostKey {self.host_key}
            AuthorizedKeysFile {root / 'authorized_keys'}
            PidFile none
            StrictModes no
            UsePAM no
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            AllowTcpForwarding yes
            LogLevel ERROR
            Match LocalPort {self.port}
              SetEnv PATH={bin_dir}:/usr/bin:/bin
            Match LocalPort {self.bare_port}
              SetEnv PATH={empty}{':' + system if system else ''}
            Match LocalPort {self.old_port}
              SetEnv PATH={old_bin}:/usr/bin:/bin
            """))
        self.known_hosts = root / "known_hosts"
        self.known_hosts.write_text("".join(f"[127.0.0.1]:{p} {' '.join(host_pub)}\n"
                                            for p in self.ports))
        self.ssh_config = self.write_client_config(root / "ssh_config")
        self.proc: subprocess.Popen | None = None
        self.log = root / "sshd.log"

    @property
    def ports(self) -> tuple[int, int, int]:
        return self.port, self.bare_port, self.old_port

    def write_client_config(self, path: Path, key: Path | None = None,
                            known_hosts: Path | None = None, agent_only: bool = False) -> Path:
        """An ssh_config with the aliases "box" (nvidia-smi on PATH), "bare" (none) and "old"
        (an older driver's); ``agent_only``: no key file named, the agent's keys are offered."""
        identity = "" if agent_only else (f"  IdentityFile {key or self.user_key}\n"
                                          "  IdentitiesOnly yes\n")
        path.write_text(textwrap.dedent(f"""\
            Host box
              Port {self.port}
            Host bare
              Port {self.bare_port}
            Host old
              Port {self.old_port}
            Host *
              HostName 127.0.0.1
              User {self.user}
              UserKnownHostsFile {known_hosts or self.known_hosts}
            """) + identity)
        return path

    def start(self) -> Sshd:
        if not Path(SSHD).exists():
            raise SshdUnavailable(f"{SSHD} is not installed (Debian: apt-get install "
                                  "openssh-server)")
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation dir
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SshdUnavailable(f"sshd exited: {self.log.read_text().strip()[-300:]}")
            try:
                for port in self.ports:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.close()
        raise SshdUnavailable("sshd did not listen within 10 s")

    def sessions(self) -> list[int]:
        """The per-connection sshd processes (the listener's children)."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                out.append(int(stat.parent.name))
        return out

    def drop_sessions(self) -> int:
        """End every connection from the server's side (as a reboot or a network cut would)."""
        pids = self.sessions()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return len(pids)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.drop_sessions()
            self.proc.terminate()
            self.proc.wait(5)


def start_sshd(root: Path) -> Sshd:
    """A started Sshd, or the test skips saying why sshd cannot run here."""
    try:
        return Sshd(root).start()
    except (SshdUnavailable, OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"sshd cannot be started here: {exc}")


_engine_lock = threading.Lock()
_engine: list = []


def shared_engine_server(demo_gguf: Path):
    """One `servescope serve` of the demo model (engine.server.serve, as the command runs it)
    for every SSH test module of the session: loading it costs seconds each time."""
    with _engine_lock:
        if not _engine:
            import atexit

            from engine import LLM
            from engine.server import serve

            # float32, not the CPU's "auto": in bfloat16 (where the CPU has bfloat16
            # instructions) a decode step's rounding differs from a prefill's, and the canary's
            # scoring-by-decoding test compares the two on every CI machine kind.
            _engine.append(serve(LLM(str(demo_gguf), device="cpu", kv_cache_tokens=1024,
                                     dtype="float32"), "127.0.0.1", 0))
            atexit.register(_engine[0].close)
        return _engine[0]
