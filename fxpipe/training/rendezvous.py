"""Where ``fxpipe run``'s rendezvous listens, and a bounded check of the endpoint before it.

torchrun's c10d rendezvous hosts its ``TCPStore`` on every interface, and its state in that store
is a pickle the launcher unpickles: anyone who can reach the port can run code in the launcher.
fxpipe registers its own rendezvous backend, ``fxpipe`` (:class:`FxpipeRendezvous`): one
``TCPStore`` hosted by node 0 at the endpoint, listening on ONE address (the loopback for a
single-node run, the address of the interface the user names with ``--bind`` for a multi-node
run), holding plain strings only. torchrun's elastic agent does the rest (worker processes,
rank assignment, restarts). Gloo and NCCL are pointed at the same interface
(``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).

:func:`probe_endpoint` connects to an endpoint that another node hosts, in a child process with
a deadline: a port held by a program that accepts and never answers, or answers garbage, ends
in one line instead of a hang or C++ stack frames.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import select
import socket
import subprocess
import sys
import time
from datetime import timedelta

from fxpipe.errors import FxpipeError

BACKEND = "fxpipe"
LOOPBACK = "127.0.0.1"
_SOCKETS: list[socket.socket] = []  # listening sockets handed to TCPStores: keep them open


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux), or ``name`` itself when it is
    already an IP address.

    Raises:
        FxpipeError: no such interface, or it has no IPv4 address.
    """
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise FxpipeError(f"--bind {name!r}: no such network interface or IP address on this "
                          f"machine (interfaces: {', '.join(names)})")
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name[:15].encode()))
        except OSError:
            raise FxpipeError(f"--bind {name!r}: that interface has no IPv4 address") from None
    return socket.inet_ntoa(packed[20:24])


def interface_name(address: str) -> str | None:
    """The interface holding IPv4 ``address`` (for GLOO/NCCL_SOCKET_IFNAME), or None."""
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except FxpipeError:
            continue
    return None


def route_address(host: str) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(host)
    except OSError:
        raise FxpipeError(f"--rdzv-endpoint host {host!r} does not resolve; give a name or "
                          "address the nodes can reach") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
            return s.getsockname()[0]
        except OSError:
            raise FxpipeError(f"no route from this machine to {host} ({target})") from None


def is_local_host(host: str) -> bool:
    try:
        target = socket.gethostbyname(host)
    except OSError:
        return False
    if ipaddress.ip_address(target).is_loopback:
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((target, 0))  # only succeeds for an address of this machine
        return True
    except OSError:
        return False


def _listening_socket(address: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    _SOCKETS.append(sock)
    return sock


def hosted_store(address: str, port: int, timeout: timedelta):
    """A ``TCPStore`` server listening on ``address:port`` only (port 0: any free one).

    Raises:
        OSError: the address is not this machine's or the port is taken.
    """
    import torch.distributed as dist

    sock = _listening_socket(address, port)
    return dist.TCPStore(address, sock.getsockname()[1], is_master=True,
                         wait_for_workers=False, timeout=timeout, master_listen_fd=sock.fileno())


def _fail(cls_name: str, message: str):
    from torch.distributed.elastic.rendezvous import api

    return getattr(api, cls_name)(message)


class NodeMismatch(Exception):
    """Two nodes of one run differ in spec, code or plan (raised in the rendezvous)."""


def _difference(mine: dict, theirs: dict, prefix: str = "") -> list[str]:
    """Key paths where two JSON-like trees differ, as ``path: A vs B`` phrases."""
    out = []
    for key in sorted(set(mine) | set(theirs), key=str):
        a, b = mine.get(key, "<absent>"), theirs.get(key, "<absent>")
        path = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += _difference(a, b, path + ".")
        elif a != b:
            out.append(f"{path}: {json_short(b)} vs {json_short(a)}")
    return out


def json_short(v) -> str:
    import json

    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


class FxpipeRendezvous:
    """torchrun rendezvous over one ``TCPStore`` that node 0 hosts at the endpoint, listening on
    the bind address only, and that holds no pickles (torch's dynamic rendezvous keeps pickled
    state in its store and unpickles it).

    Node ranks: ``--node-rank`` when given (torchrun's name), else the node hosting the
    endpoint is 0 and the others number themselves in the order they connect; two nodes
    claiming one rank, or more nodes than ``--nnodes``, are errors. Each round (the first start
    and every restart) waits, up to the join timeout, for all nodes; the first round then
    compares every node's fingerprint (spec, fxpipe code, torch version, plan) with node 0's.
    """

    def __init__(self, params):
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        self.host, self.port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
        self.bind = params.get("bind", LOOPBACK)
        self.nnodes = params.max_nodes
        rank = int(params.get("node_rank", -1))
        self.node_rank = None if rank < 0 else rank
        self.run_id = params.run_id
        self.timeout = timedelta(seconds=params.get_as_int("join_timeout", 600))
        self.fingerprint = params.get("fingerprint", "{}")
        self._store = None
        self._rank: int | None = None
        self._round = 0

    # -- the RendezvousHandler interface
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True

    # --
    def _connect(self) -> None:
        import torch.distributed as dist

        host_here = self.node_rank == 0 or (self.node_rank is None and is_local_host(self.host))
        if self.node_rank == 0 and not is_local_host(self.host):
            raise _fail("RendezvousError", f"--node-rank 0 hosts the rendezvous, but the "
                        f"endpoint host {self.host} is not this machine; run node 0 where "
                        "--rdzv-endpoint points")
        if host_here:
            try:
                self._store = hosted_store(self.bind, self.port, self.timeout)
                self._rank = 0
            except OSError as e:
                if self.node_rank == 0 or e.errno != errno.EADDRINUSE:
                    raise _fail("RendezvousError", f"cannot listen on {self.bind}:{self.port}: "
                                f"{e.strerror}") from None
                # another launcher on this machine hosts it (nodes emulated on one machine)
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, is_master=False,
                                        timeout=self.timeout)
        store = dist.PrefixStore(f"fxpipe-rdzv/{self.run_id}", self._store)
        if self._rank is None:
            self._rank = (self.node_rank if self.node_rank is not None
                          else int(store.add("next_node_rank", 1)))
        if not 0 <= self._rank < self.nnodes:
            raise _fail("RendezvousError", f"node rank {self._rank} is outside 0..{self.nnodes - 1}"
                        f" (--nnodes {self.nnodes}): more launchers joined than --nnodes, or "
                        "--node-rank is too large")
        if int(store.add(f"claimed/{self._rank}", 1)) > 1:
            raise _fail("RendezvousError", f"two launchers claim node rank {self._rank}; give "
                        "each node its own --node-rank (0 .. --nnodes - 1)")
        store.set(f"fingerprint/{self._rank}", self.fingerprint)

    def _join(self, store) -> None:
        key = f"round/{self._round}"
        if int(store.add(key + "/joined", 1)) == self.nnodes:
            store.set(key + "/all", "1")
        try:
            store.wait([key + "/all"], self.timeout)
        except Exception:  # DistStoreError on timeout; the host gone
            try:
                joined = int(store.add(key + "/joined", 0))
            except Exception:  # noqa: BLE001 - the store itself is gone
                raise _fail("RendezvousClosedError",
                            f"node 0's rendezvous at {self.host}:{self.port} went away before "
                            f"all {self.nnodes} nodes joined: node 0 stopped or failed (its "
                            "output says why)") from None
            raise _fail("RendezvousTimeoutError",
                        f"{joined} of {self.nnodes} nodes joined within "
                        f"{self.timeout.total_seconds():g} s (train.timeout_s); start `fxpipe "
                        "run` on every node with the same --rdzv-endpoint, --rdzv-id and "
                        "--nnodes") from None

    def _compare(self, store) -> None:
        import json

        mine = json.loads(self.fingerprint)
        try:
            if self._rank == 0:
                theirs = {r: json.loads(store.get(f"fingerprint/{r}").decode())
                          for r in range(1, self.nnodes)}
            else:
                theirs = {0: json.loads(store.get("fingerprint/0").decode())}
        except Exception:  # noqa: BLE001 - the host went away
            raise _fail("RendezvousClosedError",
                        f"node 0's rendezvous at {self.host}:{self.port} went away while the "
                        "nodes compared their specs and plans: node 0 stopped or failed (its "
                        "output says why)") from None
        problem = None
        for r, other in theirs.items():
            diff = _difference(mine, other)
            causes = [d for d in diff if not d.startswith("plan.")]
            diff = causes or diff  # another plan from the same inputs only when none differs
            if diff:
                problem = NodeMismatch(
                    f"node {r} and node {self._rank} (this one) differ: {'; '.join(diff[:4])} "
                    f"(node {r}'s vs this node's); every node must run the same spec, fxpipe "
                    "code and torch, and get the same plan")
                break
        # every node has read what it compares before node 0 (which hosts the store) goes on or
        # stops, so a node never meets a closed store instead of the difference
        with contextlib.suppress(Exception):
            store.add("compared", 1)
            if self._rank == 0:
                deadline = time.monotonic() + min(self.timeout.total_seconds(), 30.0)
                while int(store.add("compared", 0)) < self.nnodes and \
                        time.monotonic() < deadline:
                    time.sleep(0.05)
        if problem is not None:
            raise problem

    def next_rendezvous(self):
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.api import (RendezvousInfo,
                                                               RendezvousStoreInfo)

        if self._store is None:
            self._connect()
        self._round += 1
        store = dist.PrefixStore(f"fxpipe-rdzv/{self.run_id}", self._store)
        self._join(store)
        if self._round == 1:
            self._compare(store)
        agent_store = dist.PrefixStore(f"fxpipe-agent/{self.run_id}/{self._round}", self._store)
        return RendezvousInfo(agent_store, self._rank, self.nnodes,
                              RendezvousStoreInfo(self.host, self.port))


def _create_handler(params):
    """The ``fxpipe`` rendezvous handler (registered with torch elastic)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler

    class Handler(FxpipeRendezvous, RendezvousHandler):
        pass

    return Handler(params)


def register() -> str:
    """Register the ``fxpipe`` rendezvous backend with torch elastic; returns its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND


def socket_env(address: str) -> dict[str, str]:
    """Environment that points gloo and NCCL at the interface holding ``address``."""
    name = "lo" if ipaddress.ip_address(address).is_loopback else interface_name(address)
    if name is None:
        return {}
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


_PROBE = """
import datetime, sys
import torch.distributed as dist
print("imported", flush=True)
host, port, t = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    s = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=t))
    s.check(["fxpipe/probe"])
except Exception as e:
    print(type(e).__name__ + ": " + (str(e).splitlines() or [""])[0])
    sys.exit(1)
"""


#: seconds the endpoint check's child process may take to import torch
PROBE_START_S = 120.0


def probe_endpoint(endpoint: str, timeout_s: float) -> None:
    """Check that a torch store answers at ``endpoint`` (``HOST:PORT``) within ``timeout_s``
    seconds (in a child process: a silent peer cannot hang this one).

    Raises:
        FxpipeError: nothing listens there, it does not answer in time, or it is not a store.
    """
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:  # node 0 may start later than this node: retry until the join timeout
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                break
        except OSError as e:
            if time.monotonic() > deadline:
                raise FxpipeError(
                    f"the rendezvous at {endpoint} is not reachable: nothing answered there "
                    f"within {timeout_s:g} s (train.timeout_s; {e.strerror or e}); start "
                    f"`fxpipe run` with --node-rank 0 on the node at {host} (it hosts the "
                    "rendezvous) with this --rdzv-endpoint, or correct the endpoint") from None
            time.sleep(0.5)
    left = max(1.0, deadline - time.monotonic())
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="FATAL", TORCH_SHOW_CPP_STACKTRACES="0")
    proc = subprocess.Popen([sys.executable, "-c", _PROBE, host, port, str(left)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    try:
        # the child's import of torch is not the endpoint's time (seconds of CPU, many more on
        # a loaded machine): the store's answer is timed from the child's "imported" line; the
        # client's own retries after a refused or reset connection take a few seconds more
        ready, _, _ = select.select([proc.stdout], [], [], PROBE_START_S)
        if not ready or proc.stdout.readline().strip() != "imported":
            raise FxpipeError(f"could not check the rendezvous at {endpoint}: the checking "
                              f"process did not start within {PROBE_START_S:g} s")
        out, _ = proc.communicate(timeout=left + 10)
    except subprocess.TimeoutExpired:
        raise FxpipeError(f"the rendezvous at {endpoint} accepted the connection but did not "
                          f"answer within {timeout_s:g} s (train.timeout_s): another program "
                          "holds that port, or the node hosting it is stuck; pick a free port "
                          "for --rdzv-endpoint") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        why = (out.strip().splitlines() or ["no answer"])[-1]
        raise FxpipeError(f"the rendezvous at {endpoint} is not reachable or is not an fxpipe/"
                          f"torch store ({why}); start `fxpipe run` on the node at {host} first "
                          "(it hosts the rendezvous), or pick a free port for --rdzv-endpoint")
