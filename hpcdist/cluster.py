"""``python -m hpcdist.cluster``: a small cluster on one machine, for multi-node behaviour.

Each node is a network namespace with its own hostname (``unshare --uts``); its ``eth0`` is a
veth into a bridge in the root namespace, shaped with ``tc ... tbf`` both ways to the chosen
rate. MPI sees real nodes: ranks in one namespace share memory (MPICH's shm), ranks in
different ones talk TCP over the shaped link (UCX: ``UCX_TLS=tcp,self``,
``UCX_NET_DEVICES=eth0`` — left alone, UCX carries "inter-node" traffic over shared memory,
since every namespace sees the same /dev/shm). MPICH's hydra starts the ranks through a
launcher script that enters the node's namespace instead of ssh-ing to it.

The rest of this design: docs/cluster-in-a-box.md, "hpcdist/cluster.py"."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from .host.cli import Parser

SUBNET = "10.77.0"          # node i (1-based) is SUBNET.i; the bridge SUBNET.254


def _run(*cmd, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def available() -> str | None:
    """None when a cluster can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2 / util-linux)"
    probe = f"hpcdprobe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _burst(rate: str) -> str:
    """tbf's bucket: at least rate / HZ (250) and a few packets."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for u, f in units.items():
        if rate.endswith(u):
            bits = float(rate[:-len(u)]) * f
            return f"{max(int(bits / 8 / 250), 32 * 1024)}b"
    raise ValueError(f"link rate {rate!r}: say e.g. 10mbit, 1gbit")


class Cluster:
    """``nodes`` namespaces x ``ranks_per_node`` ranks over links of ``link`` (a tc rate such
    as "1gbit"; None: unshaped). A context manager: torn down on exit, even on an error."""

    def __init__(self, nodes: int, ranks_per_node: int = 2, link: str | None = "1gbit",
                 prefix: str = "hpcd"):
        if nodes < 1 or nodes > 200 or ranks_per_node < 1:
            raise ValueError("nodes must be in [1, 200] and ranks_per_node >= 1")
        self.nodes, self.ranks_per_node, self.link, self.prefix = nodes, ranks_per_node, link, prefix
        self.bridge = f"{prefix}br0"
        self.state_dir = f"/tmp/hpcdist-cluster-{prefix}"
        self.launcher = os.path.join(self.state_dir, "launch.sh")

    # names
    def netns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def host(self, node: int) -> str:
        return f"{SUBNET}.{node}"

    def hostname(self, node: int) -> str:
        return f"node{node}"

    def _veth(self, node: int) -> str:
        return f"{self.prefix}-v{node}"

    # lifecycle
    def up(self) -> "Cluster":
        why = available()
        if why:
            raise RuntimeError(f"cannot make a cluster here: {why}")
        self.down()                                   # leftovers of a run that died
        os.makedirs(self.state_dir, exist_ok=True)
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{SUBNET}.254/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(1, self.nodes + 1):
                ns, veth = self.netns(i), self._veth(i)
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)
                _run("ip", "link", "set", veth, "master", self.bridge, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                if self.link:
                    self.shape(i, self.link)
            self._write_launcher()
            with open(os.path.join(self.state_dir, "state.json"), "w") as f:
                json.dump({"nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                           "link": self.link, "prefix": self.prefix}, f)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill what runs in the namespaces, delete them (their veths go with them) and the
        bridge. Safe to call twice."""
        names = _run("ip", "netns", "list", check=False).stdout.split()
        mine = [n for n in names if n.startswith(f"{self.prefix}-n")]
        for ns in mine:
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in mine:
            _run("ip", "netns", "del", ns, check=False)
        # the veth pairs by their host ends: a namespace outlives ``netns del`` while a killed
        # process still holds it, and its veth with it
        links = _run("ip", "-o", "link", "show", check=False).stdout.splitlines()
        for line in links:
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(f"{self.prefix}-v"):
                _run("ip", "link", "del", name, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    def _write_launcher(self) -> None:
        # hydra runs ``launch.sh [ssh options] HOST COMMAND``: enter HOST's namespace instead
        script = f"""#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
node=${{host##*.}}
exec ip netns exec {self.prefix}-n$node unshare --uts sh -c "hostname node$node; exec $*"
"""
        with open(self.launcher, "w") as f:
            f.write(script)
        os.chmod(self.launcher, 0o755)

    # launching
    def mpiexec(self, n: int | None = None, mpiexec: str | None = None,
                env: dict | None = None) -> list:
        """The mpiexec argv prefix that starts ``n`` ranks (default: all) block-placed on the
        nodes (``ranks_per_node`` each, ranks of one node consecutive)."""
        exe = mpiexec or os.path.join(os.path.dirname(sys.executable), "mpiexec")
        if not os.path.exists(exe):
            exe = "mpiexec"
        n = n or self.nodes * self.ranks_per_node
        argv = [exe, "-launcher", "ssh", "-launcher-exec", self.launcher,
                "-hosts", ",".join(self.host(i) for i in range(1, self.nodes + 1)),
                "-iface", self.bridge, "-n", str(n), "-ppn", str(self.ranks_per_node),
                "-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_NET_DEVICES", "eth0",
                "-genv", "GLOO_SOCKET_IFNAME", "eth0",
                "-genv", "MASTER_ADDR", self.host(1)]
        for k, v in (env or {}).items():
            argv += ["-genv", k, str(v)]
        return argv

    # the links, as a fault injector and a meter
    def shape(self, node: int, rate: str | None) -> None:
        """Cap node's link both ways at ``rate`` (None: unshaped)."""
        for prefix, dev in (([], self._veth(node)), (["ip", "netns", "exec", self.netns(node)],
                                                     "eth0")):
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate:
                _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", _burst(rate), "latency", "400ms")

    def set_link(self, node: int, up: bool) -> None:
        """Take node's link down (``ip link set down``) or back up."""
        _run("ip", "link", "set", self._veth(node), "up" if up else "down")

    def kill_node(self, node: int, sig: int = signal.SIGKILL) -> list:
        """A node that crashes: its link goes silent (no FIN, no RST reaches anyone, as when
        power is lost), then ``sig`` goes to every process in its namespace, the launcher's
        proxy included."""
        self.set_link(node, up=False)
        pids = [int(p) for p in _run("ip", "netns", "pids", self.netns(node),
                                     check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def tx_bytes(self, node: int) -> int:
        """Bytes the node has sent over its link so far."""
        r = _run("ip", "netns", "exec", self.netns(node), "cat",
                 "/sys/class/net/eth0/statistics/tx_bytes")
        return int(r.stdout)


def _from_state(prefix: str) -> Cluster:
    path = f"/tmp/hpcdist-cluster-{prefix}/state.json"
    if not os.path.exists(path):
        return Cluster(1, prefix=prefix)
    s = json.load(open(path))
    return Cluster(s["nodes"], s["ranks_per_node"], s["link"], s["prefix"])


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.cluster",
                description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("up", "run"):
        p = sub.add_parser(cmd)
        p.add_argument("--nodes", type=int, default=2)
        p.add_argument("--ranks-per-node", type=int, default=2)
        p.add_argument("--link", default="1gbit", help="tc rate (10mbit, 1gbit, ...); none: "
                       "unshaped")
        p.add_argument("--prefix", default="hpcd")
        if cmd == "run":
            p.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("down").add_argument("--prefix", default="hpcd")
    args = ap.parse_args(argv)
    if args.cmd == "down":
        _from_state(args.prefix).down()
        return 0
    link = None if args.link == "none" else args.link
    cluster = Cluster(args.nodes, args.ranks_per_node, link, args.prefix)
    try:
        cluster.up()
    except (RuntimeError, ValueError) as e:
        print(f"python -m hpcdist.cluster: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "up":
        print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, links {link or 'unshaped'}; "
              f"run under:\n  " + " ".join(cluster.mpiexec()) + "\nand take it down with: "
              f"python -m hpcdist.cluster down --prefix {args.prefix}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command[:1] == ["python"]:
        command[0] = sys.executable
    try:
        return subprocess.run(cluster.mpiexec() + command).returncode
    finally:
        cluster.down()


if __name__ == "__main__":
    sys.exit(main())
