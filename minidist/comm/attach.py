"""Attach this terminal to a rank's pdb: one stopped by `debug.breakpoint_on(rank)`, or the rank
`python -m minidist.comm.rankpdb --rank R script.py` runs under pdb.

    python -m minidist.comm.attach 4445            # port = MINIDIST_PDB_PORT (4444) + rank
    python -m minidist.comm.attach 4445 --wait 30  # retry until the rank listens

Lines typed here go to that rank's pdb, and everything it prints comes back, its questions
included (`cl` asks "Clear all breaks?" here, not on the rank's own stdin). The console ends
when the rank closes the connection: it finished, or `q` ended the job. Ctrl-D is pdb's EOF,
which ends the job like `q` (minidist/comm/rankpdb.py).
Tests: tests/test_comm.py::test_breakpoint_on_one_rank, tests/test_debugging.py.
"""
import argparse
import socket
import sys
import threading
import time


def connect(port, host="127.0.0.1", wait=0.0):
    """A connection to the rank's pdb; retried for `wait` seconds while nothing listens."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return socket.create_connection((host, port))
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def attach(port, host="127.0.0.1", wait=0.0):
    """Forward stdin to the rank's pdb and print what it says, until it closes."""
    sock = connect(port, host, wait)

    def forward_stdin():
        for line in sys.stdin:
            sock.sendall(line.encode())
        sock.shutdown(socket.SHUT_WR)          # pdb reads EOF
    # a daemon: when the rank closes the connection, nobody waits for another line typed here
    threading.Thread(target=forward_stdin, daemon=True).start()
    for data in iter(lambda: sock.recv(4096), b""):
        sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()
    sock.close()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidist.comm.attach",
                                description="Attach this terminal to one rank's pdb.")
    p.add_argument("port", type=int, help="MINIDIST_PDB_PORT (default 4444) + the rank")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="keep trying this long while nothing listens yet (default: 0)")
    a = p.parse_args(argv)
    try:
        attach(a.port, a.host, a.wait)
    except ConnectionRefusedError:
        sys.stderr.write(f"error: nothing listens on {a.host}:{a.port} (ConnectionRefusedError):"
                         " start the job first and wait for its 'waiting for a debugger on HOST'"
                         " line, then run this on HOST (the rank listens on its own 127.0.0.1),"
                         " or pass --wait SECONDS\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
