"""The floor for a scan of every process's fds: list /proc, readlink every /proc/PID/fd/N.

No parsing, no classification: what any tool that answers "who holds this file" through
/proc must at least do. Run as its own process (same interpreter as xpuctl), so its time
includes interpreter start-up, as xpuctl's does. Prints the number of fds it read.
"""

import os


def main() -> None:
    n = 0
    readlink = os.readlink
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        base = "/proc/" + d + "/fd/"
        try:
            fds = os.listdir(base)
        except OSError:
            continue
        for fd in fds:
            try:
                readlink(base + fd)
            except OSError:
                continue
            n += 1
    print(n)


if __name__ == "__main__":
    main()
