"""Scripts that must run in a process of their own (a crash, a SIGKILL, a SIGBUS must end it, not pytest), without
an interpreter start and the same imports for each: a server imports them once, then forks one child per script.

``ForkServer(imports, env)`` starts ``python -X faulthandler`` with ``imports`` (Python source, run once), and
``server.run(script, *argv)`` runs ``script`` in a child forked from it as ``python -c script *argv`` would: its
``sys.argv``, its stdout and stderr (returned), its exit (threads joined, threading's exit hooks and atexit run),
its exit code, ``-N`` when signal N killed it (as ``subprocess`` reports it). The imports must be those the script itself makes before anything else: a module imported earlier
than the script replaces a name keeps the name it bound (the scripts here replace classes and functions), and
nothing may start OpenCL (``pyopencl`` imported) before a fork. The server refuses to start if it does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

SERVER = r"""
import json, os, signal, sys, time, traceback
exec(compile(sys.argv[1], "<imports>", "exec"), {"__name__": "__imports__"})
assert "pyopencl" not in sys.modules, "the server must not load OpenCL before it forks"
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(request["out"] + "." + name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = ["-c", *request["argv"]]
            exec(compile(request["script"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)  # as the interpreter prints sys.exit("message")
        except BaseException:
            traceback.print_exc()
        finally:
            try:  # an interpreter's exit: non-daemon threads and threading's exit hooks, then atexit
                import atexit, threading
                threading._shutdown()
                atexit._run_exitfuncs()
            except BaseException:
                traceback.print_exc()
                code = code or 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            done, status = os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class ForkServer:
    def __init__(self, imports: str, env: dict | None = None, cwd: str | None = None):
        self._dir = tempfile.mkdtemp(prefix="fastckpt-forkserver-")
        self._count = 0
        self.process = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", SERVER, imports], env=env,
                                        cwd=cwd, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, script: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        self._count += 1
        out = os.path.join(self._dir, str(self._count))
        self.process.stdin.write(json.dumps({"script": script, "argv": list(argv), "out": out,
                                             "timeout": timeout}) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        assert reply, f"the fork server died (exit {self.process.poll()})"
        texts = []
        for kind in ("stdout", "stderr"):
            with open(f"{out}.{kind}", errors="replace") as f:
                texts.append(f.read())
            os.unlink(f"{out}.{kind}")
        return subprocess.CompletedProcess(["-c", script, *argv], json.loads(reply)["returncode"], *texts)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)
        os.rmdir(self._dir)
