"""Bounded reads: another process's /proc files and device sysfs are read in a reader process
that the caller can abandon.

Why a process and not a thread: on a wedged host a read can sleep in the kernel for good (a
`cmdline` waiting for the mmap lock of a process stuck in the driver, an `fdinfo` inside the
driver, a sysfs attribute of a device in reset). A thread in uninterruptible sleep keeps its
whole process from exiting: exit_group waits for every thread, and the shell's wait() with
it. A child process can be left behind: the caller kills it (it dies when the read returns,
if ever), does not wait for it, and goes on with a new one.

Four modules, imported in this order and never back:

- `protocol`: what both sides agree on (the shared page, the pipe's framing, which files
  block together, `Blocked`, `BlockedRead`, the reader's traceback) and `Direct`, reads made
  in this process.
- `child`: the reader's side. `Published` publishes each read in the shared page.
- `process`: a reader process's life: started (forked, or spawned when other threads run),
  released, killed, reaped through its pidfd.
- `caller`: the caller's side. `Reader` starts a reader, sends it a whole function (a scan, a
  per-pid pass, one read) and watches the page while it runs: a read that has not returned
  after `bound` seconds is *blocked*. Its group is recorded, the reader (and its split
  helper, host/split.py, which has its own slot) is killed, and the request runs again in a
  fresh reader, where any read in a blocked group fails at once with `Blocked` (an OSError,
  ETIMEDOUT). So one wedged process costs about one bound, not one per file, and callers
  that already treat an unreadable file as unknown need no change. A request can also be
  sent now and its reply collected later (`Reader.submit`): doctor loads what judges a scan
  while the reader takes it.

A Host is given its way of reading when it is built (`Direct`, a `Reader`, or in the reader
a `Published`), and every read of it goes there.
"""
