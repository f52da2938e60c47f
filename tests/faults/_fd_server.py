"""A server of the security suite in a process of its own, under a low descriptor limit.

    python _fd_server.py KIND LIMIT    (KIND: store, task-store or log)

Prints the server's address, then answers each line on stdin: "works" runs a
real client's round trip against it and prints "ok" or the error; "fill"
opens files until no descriptor is left and prints how many; "free" closes
them.  EOF ends it.
"""
from __future__ import annotations

import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _fault_attacks as attacks  # noqa: E402


def main() -> None:
    kind, limit = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    service = attacks.make_service(kind, b"\x5a" * 32)
    print(service.address, flush=True)
    held = []
    for line in sys.stdin:
        cmd = line.strip()
        try:
            if cmd == "works":
                service.works()
                print("ok", flush=True)
            elif cmd == "fill":
                while True:
                    try:
                        held.append(open(os.devnull))
                    except OSError:
                        break
                print(len(held), flush=True)
            elif cmd == "free":
                while held:
                    held.pop().close()
                print("freed", flush=True)
        except Exception as exc:  # the test reads the answer
            print(f"failed: {type(exc).__name__}: {exc}", flush=True)
    service.close()


if __name__ == "__main__":
    main()
