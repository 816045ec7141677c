"""Attach this terminal to a rank stopped by `debug.breakpoint_on(rank)`.

    python -m minidist.comm.attach 4445      # port = MINIDIST_PDB_PORT (4444) + rank

Lines typed here go to that rank's pdb; its output comes back. Ctrl-D detaches.
Tests: tests/test_comm.py::test_breakpoint_on_one_rank.
"""
import socket
import sys
import threading


def attach(port, host="127.0.0.1"):
    sock = socket.create_connection((host, port))

    def show():
        for data in iter(lambda: sock.recv(4096), b""):
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()
    reader = threading.Thread(target=show, daemon=True)
    reader.start()
    for line in sys.stdin:
        sock.sendall(line.encode())
    sock.shutdown(socket.SHUT_WR)
    reader.join()   # until the rank closes the connection (it exits, or pdb is left)


if __name__ == "__main__":
    attach(int(sys.argv[1]))
