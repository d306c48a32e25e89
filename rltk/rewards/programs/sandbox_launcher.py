"""The sandbox's inside half: run as PID 1 of fresh namespaces, build a private root, run each test.

Not imported by rltk: :mod:`rltk.rewards.programs.sandbox` starts it as
``unshare --net --pid --mount --ipc --uts --fork --kill-child -- PYTHON -I -S -B sandbox_launcher.py``
with an empty environment and a JSON job on stdin, and reads one JSON line of
results from its stdout. It uses the standard library only (``-S``: no
site-packages), because it runs before anything else is set up.

What it does, in order (as root inside the new mount and PID namespaces):

1. makes every mount private, so nothing below reaches the host's mount table;
2. mounts a size-limited tmpfs on ``/tmp`` (this namespace's own) and builds a
   new root in it: read-only, ``nosuid``/``nodev`` bind mounts of ``/usr``,
   ``/etc`` and, for an interpreter outside ``/usr``, its binary, standard
   library (with an empty ``site-packages``) and ``libpython`` under
   ``/opt/python`` (never its host path), the ``/bin``-style symlinks,
   ``/dev/null``, ``/dev/zero``, ``/dev/urandom``, a fresh ``/proc`` of the new
   PID namespace, an empty ``/tmp`` and the scratch directory ``/work`` that
   holds the program and nothing else. ``/home``, ``/root``, the host's
   ``/tmp``, the trainer's working directory and every other path do not
   exist there. The root itself and the program file end up read-only
   mounts; ``/work`` and ``/tmp`` are the only writable places;
3. ``chroot``s into it;
4. for each test: forks a child that sets the rlimits, drops to the job's
   unprivileged uid (no groups) or, in a user namespace, drops every
   capability for good, sets ``no_new_privs`` and execs the harness with
   an almost empty environment; waits for it at most ``timeout_s`` of wall
   clock; then kills every other process of the namespace (``kill(-1)``: a
   program's forks and daemons go too) and reaps them;
5. prints ``{"results": [...]}``, one entry per test.
"""

import ctypes
import json
import os
import resource
import shutil
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 28, 47, 4
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED, SECBIT_NO_SETUID_FIXUP, SECBIT_NO_SETUID_FIXUP_LOCKED = 1, 2, 4, 8
SECBIT_KEEP_CAPS_LOCKED = 32
ROOT = "/tmp/root"

# What the harness (the program's own interpreter, pid != launcher) reports on fd 3, and how it exits.
# It never judges a probe test: it evaluates the probes (the parts of the test that call the program)
# and reports their values as plain data; the supervisor outside compares them with the expected ones,
# which never enter the sandbox (rltk.rewards.programs.assert_tests).
HARNESS = r'''
import errno, json as _json, os, sys
_status = os.fdopen(3, "w")
_nonce = open("/work/.nonce").read(); os.unlink("/work/.nonce")
_me = os.getpid()
def _report(word, payload=None):
    if os.getpid() == _me:  # a fork of the program never reports for it
        _status.write(word + " " + _nonce + "\n" + payload if payload is not None else word); _status.flush()
    os._exit(0)
%(encoder)s
_mode, _index = sys.argv[1], int(sys.argv[2])
# Probe tests import the program as a module (its `if __name__ == "__main__":` part does not run);
# stdin/stdout cases run it as the main program.
_ns = {"__name__": "__main__" if _mode == "io" else "solution", "__builtins__": __builtins__}
try:
    _src = open("/work/solution.py").read()
    _test = _json.load(open("/work/test_%%d.json" %% _index)) if _mode == "probe" else None
    del sys.argv[1:]
    exec(compile(_src, "solution.py", "exec"), _ns)
    if _mode == "probe":
        for _stmt in _test["setup"]:
            exec(_stmt, _ns)
        _values = [encode_value(eval(_probe, _ns)) for _probe in _test["probes"]]
        sys.stdout.flush(); sys.stderr.flush()
        _report("evaluated", _json.dumps(_values))
    sys.stdout.flush(); sys.stderr.flush()
except AssertionError:
    _report("failed")
except MemoryError:
    _report("memory")
except SystemExit as e:
    if _mode == "probe" or e.code not in (None, 0):
        _report("failed")
    sys.stdout.flush()
    _report("pass", "")
except OSError as e:
    if e.errno == errno.EFBIG:
        _report("file_size")
    if e.errno == errno.EAGAIN:
        _report("processes")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENETUNREACH, errno.ENETDOWN,
                   errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.EAFNOSUPPORT, errno.ENOENT):
        _report("denied")
    _report("error")
except BaseException:
    _report("error")
_report("pass", "")
'''


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _mount(libc, src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {target} ({fstype}): {os.strerror(err)}")


def _bind_ro(libc, src, target, nodev=True):
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(libc, src, target, None, MS_BIND)
    _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (MS_NODEV if nodev else 0))


def build_root(job):
    libc = _libc()
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    mb = job["scratch_mb"]
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={mb}m,nr_inodes={mb * 64},mode=0755")
    os.makedirs(ROOT)
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + top
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(ROOT, top))
        elif os.path.isdir(host):
            _bind_ro(libc, host, ROOT + host)
    for path in ["/usr", "/etc"]:
        if not os.path.exists(ROOT + path) or not os.listdir(ROOT + path):
            _bind_ro(libc, path, ROOT + path)
    # The interpreter, when it does not live under /usr: only its binary, standard library and libpython,
    # at a neutral path; "" mounts an empty folder (over the standard library's site-packages).
    os.makedirs("/tmp/empty")
    for host, inside in job["mounts"]:
        _bind_ro(libc, host or "/tmp/empty", ROOT + inside)
    for dev in ("null", "zero", "urandom", "random"):  # device nodes: a mount without nodev
        _bind_ro(libc, "/dev/" + dev, ROOT + "/dev/" + dev, nodev=False)
    os.makedirs(ROOT + "/proc")
    _mount(libc, "proc", ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV)
    os.makedirs(ROOT + "/tmp", mode=0o1777)
    os.chmod(ROOT + "/tmp", 0o1777)
    os.makedirs(ROOT + "/work")
    _chown(job, ROOT + "/work")
    with open(ROOT + "/work/solution.py", "w") as f:
        f.write(job["program"])
    with open(ROOT + "/.harness.py", "w") as f:
        f.write(HARNESS % {"encoder": job["encoder"]})
    # Only /work and /tmp stay writable, and the program file in /work does not: the root itself
    # becomes a read-only mount. (Under a user namespace the program's uid owns these files, so
    # permissions alone would not protect the harness or the next test's program.)
    for rw in ("/work", "/tmp"):
        _mount(libc, ROOT + rw, ROOT + rw, None, MS_BIND)
    _bind_ro(libc, ROOT + "/work/solution.py", ROOT + "/work/solution.py")
    _mount(libc, ROOT, ROOT, None, MS_BIND | MS_REC)
    _mount(libc, None, ROOT, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(ROOT)
    os.chdir("/work")


def _chown(job, path):
    if job["uid"] is not None:  # None: a user namespace, where the program keeps the launcher's uid
        os.chown(path, job["uid"], job["uid"])


def _limits(job):
    cpu, mem = job["cpu_s"], job["memory_mb"] << 20
    return [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at cpu_s, SIGKILL a second later
        (resource.RLIMIT_AS, (mem, mem)),
        (resource.RLIMIT_FSIZE, (job["file_size_mb"] << 20,) * 2),
        # Counts the uid's processes and threads; in a user namespace also `unshare` and this launcher,
        # which share the program's uid there: two more, so the program's own budget is the same.
        (resource.RLIMIT_NPROC, (job["processes"] + (2 if job["uid"] is None else 0),) * 2),
        (resource.RLIMIT_NOFILE, (64, 64)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]


def _child(job, mode, index):
    # Runs in the fork, as root still: limits first, then the uid (NPROC binds a non-root uid only).
    try:
        for what, value in _limits(job):
            resource.setrlimit(what, value)
        libc = ctypes.CDLL(None)
        if job["uid"] is not None:
            os.setgroups([])
            os.setgid(job["uid"])
            os.setuid(job["uid"])
        else:
            # Uid 0 of a user namespace: keep the uid, lose every capability for good. NOROOT stops
            # exec from granting uid 0 the full set; the bounding and ambient sets are emptied too.
            if libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP
                          | SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED, 0, 0, 0) != 0:
                os._exit(122)
            for cap in range(64):
                libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap: ignored
            libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            os._exit(121)
        stdin = os.open("/work/.stdin", os.O_RDONLY) if mode == "io" else os.open("/dev/null", os.O_RDONLY)
        out = os.open("/work/.stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open("/dev/null", os.O_WRONLY)
        status = os.open("/work/.status", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((stdin, 0), (out, 1), (err, 2), (status, 3)):
            os.dup2(fd, target)
        os.closerange(4, 1 << 16)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               **job["python_env"]}
        py = job["python"]
        os.execve(py, [py, "-I", "-S", "-B", "/.harness.py", mode, str(index)], env)
    finally:
        os._exit(120)


def _kill_all():
    # PID 1 of the namespace: -1 reaches every other process in it, whatever its group or session.
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def run_test(job, mode, index, test):
    nonce = os.urandom(16).hex()
    for name in os.listdir("/work"):  # a fresh scratch directory per test, but for the program itself
        if name != "solution.py":
            path = "/work/" + name
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
    with open("/work/.nonce", "w") as f:
        f.write(nonce)
    if mode == "probe":
        with open(f"/work/test_{index}.json", "w") as f:
            json.dump(test, f)
    else:
        with open("/work/.stdin", "w") as f:
            f.write(test["input"])
    for name in os.listdir("/work"):  # solution.py stays root's: no test can rewrite the next one's program
        if name != "solution.py":
            _chown(job, "/work/" + name)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(job, mode, index)
    deadline = min(started + job["timeout_s"], job["sample_deadline"])
    status = usage = None
    while status is None:
        done, raw, rusage = os.wait4(pid, os.WNOHANG)
        if done:
            status, usage = raw, rusage
        elif time.monotonic() > deadline:
            break
        else:
            time.sleep(0.005)
    _kill_all()
    result = {"wall_s": round(time.monotonic() - started, 3)}
    if status is None:
        result["outcome"] = "timeout"
        return result
    try:
        with open("/work/.status", encoding="utf-8", errors="replace") as f:
            reported = f.read(job["file_size_mb"] << 20)
    except OSError:
        reported = ""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        result["outcome"] = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}.get(sig, "killed")
        if sig == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= job["cpu_s"]:
            result["outcome"] = "cpu"
        elif sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT):
            result["outcome"] = "crashed"
        return result
    head, _, payload = reported.partition("\n")
    word = head.split(" ")[0]
    if word == "pass" and head == "pass " + nonce and mode == "io":
        with open("/work/.stdout", "rb") as f:
            got = f.read(job["file_size_mb"] << 20).decode("utf-8", "replace")
        result["outcome"] = "pass" if _same_output(got, test["output"]) else "wrong_output"
    elif word == "evaluated" and head == "evaluated " + nonce and mode == "probe":
        result["outcome"], result["values"] = "evaluated", payload  # judged outside, on plain data
    elif word in ("failed", "memory", "file_size", "processes", "denied", "error"):
        result["outcome"] = word
    else:  # exited without the harness's word: os._exit() in the program, or a forged report
        result["outcome"] = "error"
    return result


def _same_output(got, want):
    norm = lambda text: "\n".join(line.rstrip() for line in text.strip("\n").split("\n")).rstrip()
    return norm(got) == norm(want)


def main():
    job = json.loads(sys.stdin.read())
    build_root(job)
    results = []
    mode = job["mode"]
    # sample_timeout_s caps all tests together: a test started late gets what is left, and tests past
    # the cap are not started (each counts as a timeout).
    budget = job["sample_timeout_s"]
    job["sample_deadline"] = time.monotonic() + budget if budget is not None else float("inf")
    for index, test in enumerate(job["tests"]):
        if time.monotonic() >= job["sample_deadline"]:
            results.append({"wall_s": 0.0, "outcome": "timeout"})
            continue
        results.append(run_test(job, mode, index, test))
    sys.stdout.write(json.dumps({"results": results}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # the parent reads this line and raises with it
        sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        sys.stdout.flush()
        os._exit(1)
