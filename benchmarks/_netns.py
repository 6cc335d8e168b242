"""Hosts on one machine: Linux network namespaces on a bridge, each with its own address, and
names resolved from a hosts file the fabric writes (what DNS is to the services).

Each host is a namespace joined to the bridge by a veth pair.  The bridge itself lives in a
namespace of its own (the "switch"), and this machine joins it by one more veth pair: frames
between hosts are bridged there, where no firewall rule exists, so a Docker engine on this
machine (its FORWARD DROP policy with ``br_netfilter`` calling iptables for bridged frames)
cannot drop them.  ``ip netns exec`` bind-mounts
``/etc/netns/<ns>/hosts`` over ``/etc/hosts`` for what it runs, and glibc reads that file on
every lookup, so rewriting it in place (same inode) changes what every host resolves, the way
a DNS record changes.  ``cut(host)`` takes its link down: packets to it vanish, with no reset,
as when a machine falls off the network.  Needs root (or CAP_NET_ADMIN) and ``ip``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (tries one and removes it)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"mmprobe{os.getpid()}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace ({r.stderr.strip() or 'ip netns add failed'}): needs root"
    _ip("netns", "del", name, check=False)
    return None


def _free_subnet(tag: int) -> str:
    """A 10.x.y.0/24 no interface here is on (two fabrics at once never share one)."""
    taken = _ip("-4", "-o", "addr", check=False).stdout
    for i in range(12500):
        k = (tag + i) % 12500
        subnet = f"10.{200 + k // 250}.{k % 250}"
        if f" {subnet}." not in taken:
            return subnet
    raise RuntimeError("no free 10.200-249.x.0/24 subnet")


@dataclass
class Host:
    name: str
    ns: str
    veth: str  # the bridge side of its link (in the switch namespace)
    ip: str
    procs: list[subprocess.Popen] = field(default_factory=list)


class Fabric:
    """A bridge (in the switch namespace), this machine at ``<subnet>.1`` and hosts
    ``<subnet>.<n>`` on it; ``names`` maps each DNS name to its addresses (the hosts file every
    namespace sees)."""

    def __init__(self, subnet: str | None = None) -> None:
        tag = os.getpid() % 100000
        self.tag = tag
        self.subnet = subnet or _free_subnet(tag)
        self.switch = f"mm{tag}-switch"
        self.bridge = f"mmbr{tag}"
        self.uplink = f"mmup{tag}"  # this machine's side of its link to the switch
        self.gateway_ip = f"{self.subnet}.1"
        self.hosts: dict[str, Host] = {}
        self.names: dict[str, list[str]] = {}
        self._next = 10
        _ip("netns", "add", self.switch)
        try:
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", self.bridge, "up")
            _ip("link", "add", self.uplink, "type", "veth", "peer", "name", "uplink", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", "uplink", "master", self.bridge, "up")
            _ip("addr", "add", f"{self.gateway_ip}/24", "dev", self.uplink)
            _ip("link", "set", self.uplink, "up")
        except subprocess.CalledProcessError:
            self.close()
            raise

    # ---- hosts ----------------------------------------------------------------------------
    def add_host(self, name: str) -> Host:
        """A new namespace with its own address on the bridge (its hosts file written now)."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        n = self._next
        self._next += 1
        ns, veth = f"mm{self.tag}-{name}", f"mv{self.tag}x{n}"
        ip = f"{self.subnet}.{n}"
        _ip("netns", "add", ns)
        (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
        self._write_hosts(ns)
        # no DNS server on this network: a name missing from the hosts file fails at once
        (NETNS_ETC / ns / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        _ip("-n", self.switch, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch, "link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        host = Host(name, ns, veth, ip)
        self.hosts[name] = host
        return host

    def cut(self, host: Host) -> None:
        """Take the host's link down: from now on nothing reaches it and nothing leaves it."""
        _ip("-n", self.switch, "link", "set", host.veth, "down")

    def run(self, host: Host, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (its own process group, output appended to ``log``)."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        host.procs.append(proc)
        return proc

    # ---- names ----------------------------------------------------------------------------
    def set_name(self, name: str, ips: list[str]) -> None:
        """Point ``name`` at ``ips`` (none: remove it) in every host's hosts file."""
        if ips:
            self.names[name] = list(ips)
        else:
            self.names.pop(name, None)
        for h in self.hosts.values():
            self._write_hosts(h.ns)

    def _write_hosts(self, ns: str) -> None:
        lines = ["127.0.0.1 localhost"]
        lines += [f"{ip} {name}" for name, ips in sorted(self.names.items()) for ip in ips]
        path = NETNS_ETC / ns / "hosts"
        # in place (same inode): the copy bind-mounted into running processes sees the change
        with open(path, "a+") as f:
            f.seek(0)
            f.truncate()
            f.write("\n".join(lines) + "\n")

    # ---- teardown -------------------------------------------------------------------------
    @staticmethod
    def stop(proc: subprocess.Popen, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)

    def close(self) -> None:
        """Stop every process, remove every namespace, link, hosts file and the bridge (deleting
        a namespace deletes the links in it; a veth goes with either end)."""
        for h in self.hosts.values():
            for p in h.procs:
                self.stop(p, timeout=5.0, sig=signal.SIGKILL)
        for h in self.hosts.values():
            _ip("netns", "del", h.ns, check=False)
            shutil.rmtree(NETNS_ETC / h.ns, ignore_errors=True)
        _ip("link", "del", self.uplink, check=False)
        _ip("netns", "del", self.switch, check=False)
        self.hosts.clear()

    def __enter__(self) -> "Fabric":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
