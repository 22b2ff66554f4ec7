"""The host-project test: the apps as a user gets them, wired by the integration guide's snippets.

For each Django version (5.2 LTS on Python 3.11, the newest 6.x on Python >= 3.12):

1. build the wheel (`pip wheel . --no-deps`) from a copy of the tree's files (tracked, or new and
   not ignored), so no stale `build/` of an earlier build ends up in it, and check that every
   file of the two packages is in it;
2. install it in a virtualenv under var/host/ with the extras the guide's `pip install` names,
   constrained by requirements.lock (5.2) or requirements-django6.txt (6.x); the virtualenv is
   kept between runs, keyed by the dependencies, the constraints and the interpreter, and only
   the wheel is reinstalled;
3. `django-admin startproject hostsite`, then every snippet of docs/add-to-your-project.md
   applied literally: in `# settings.py` and `# urls.py` sections, a list written `[..., a, b]`
   gets `a, b` appended to the project's list of that name, imports go after the file's
   imports, any other statement after its last line; any other `# <file>.py` section is written
   whole. `mysite` and `myapp`, the guide's names for the project and the user's app, become
   `hostsite` and `shop`. A snippet that cannot be applied fails the test, named;
4. `manage.py check`, `migrate`, a staff superuser, then `durable_worker`, `durable_poller`
   and daphne (the guide's command) as subprocesses; the guide's `start(...)` snippet in
   `manage.py shell`, waiting until the run is `completed` (and evaluating a CEL key there, so
   its bindings must come with the wheel's dependencies); then, logged in through the admin's
   login form, the dashboard's overview and run page and the admin's run page over HTTP: 200,
   the run id on the run pages; and the dashboard's WebSocket through the guide's asgi.py (a 101
   and a first tick).

Every process is stopped on every way out. One PASS/FAIL line per version; exit status 1 if any
failed. Usage: `python .ci/host_project.py [--only 5.2|6] [--python-django52 PY] [--python-django6 PY]`
(`make test-host-project`; `make test` runs it beside the other passes).
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import hashlib
import http.cookiejar
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "add-to-your-project.md"
VAR = ROOT / "var" / "host"
PIP_CACHE = ROOT / "var" / "pip-cache"
PROJECT = "hostsite"  # the guide's `mysite`
APP = "shop"  # the guide's `myapp`
PLACEHOLDERS = {"mysite": PROJECT, "myapp": APP}
MERGED_FILES = ("settings.py", "urls.py")  # a snippet of these adds to the project's file
PROJECT_FILES = ("settings.py", "urls.py", "asgi.py", "wsgi.py")  # live in the project package
#: Each app's folder in the repository, and the import name it is installed under.
PACKAGES = {"durable_flow": "durable_flow", "dashboard": "durable_flow_dashboard"}
# Waits for something to happen (a run to complete, a server to listen), not verdicts on speed:
# generous, since `make test` runs this beside the other passes on a busy machine.
TIMEOUT_S = float(os.environ.get("HOST_PROJECT_TIMEOUT_S", "180"))
PASSWORD = "host-project-password"  # a throwaway staff user in a throwaway database


class HostProjectError(Exception):
    """The test failed: the message says at which step and why."""


# --- the guide's snippets -------------------------------------------------------------------


@dataclass
class Snippet:
    """One `# <file>` section of a fenced python block (or a whole block without a header)."""

    path: str | None  # e.g. "settings.py", "myapp/workflows.py"; None: not a file
    code: str
    line: int  # the guide's line where the section starts

    @property
    def name(self) -> str:
        return f"{GUIDE.relative_to(ROOT)}:{self.line} ({'# ' + self.path if self.path else 'no file header'})"


@dataclass
class Guide:
    snippets: list[Snippet] = field(default_factory=list)
    shell: list[tuple[int, str]] = field(default_factory=list)  # (line, code) of ```sh blocks


FENCE = re.compile(r"^```(\w*)\s*$")
FILE_HEADER = re.compile(r"^# ([\w./-]+\.py)\b")


def substitute(text: str) -> str:
    for placeholder, name in PLACEHOLDERS.items():
        text = re.sub(rf"\b{placeholder}\b", name, text)
    return text


def read_guide() -> Guide:
    """The fenced blocks of the guide, python ones cut at their `# <file>.py` header lines."""
    guide = Guide()
    lines = GUIDE.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        language, start = opening.group(1), i + 1
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        body = lines[start:i]
        i += 1
        if language == "sh":
            guide.shell.append((start + 1, substitute("\n".join(body))))
        elif language == "python":
            section: list[str] = []
            path: str | None = None
            section_line = start + 1
            for offset, text in enumerate([*body, "# end.py"]):
                header = FILE_HEADER.match(text)
                if header:
                    if any(line.strip() for line in section):
                        guide.snippets.append(Snippet(path, substitute("\n".join(section)) + "\n", section_line))
                    path, section, section_line = substitute(header.group(1)), [], start + 1 + offset
                else:
                    section.append(text)
    return guide


def guide_extras(guide: Guide) -> str:
    for line, code in guide.shell:
        found = re.search(r"pip install \"?durable-flow\[([\w,-]+)\]", code)
        if found:
            print(f"  the guide's extras ({GUIDE.name}:{line}): {found.group(1)}")
            return found.group(1)
    raise HostProjectError(f'{GUIDE.relative_to(ROOT)}: no sh block with `pip install "durable-flow[...]"`')


def guide_command(guide: Guide, pattern: str) -> str:
    """The line of a ```sh block matching `pattern` (a regex), comment dropped."""
    for _, code in guide.shell:
        for text in code.splitlines():
            if re.search(pattern, text):
                return text.split("#", 1)[0].strip()
    raise HostProjectError(f"{GUIDE.relative_to(ROOT)}: no sh line matching {pattern!r}")


def start_snippet(guide: Guide) -> Snippet:
    for snippet in guide.snippets:
        if snippet.path is None and "from durable_flow import start" in snippet.code:
            return snippet
    raise HostProjectError(f"{GUIDE.relative_to(ROOT)}: no python block with `from durable_flow import start`")


def _has_ellipsis(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and n.value is Ellipsis for n in ast.walk(node))


def _list_assignment(tree: ast.Module, name: str) -> ast.List | None:
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == name
            and isinstance(node.value, ast.List)
        ):
            return node.value
    return None


def _offset(text: str, line: int, column: int) -> int:
    """The string index of an AST (1-based line, 0-based UTF-8 column) position."""
    head = "".join(text.splitlines(keepends=True)[: line - 1])
    row = text.splitlines(keepends=True)[line - 1]
    return len(head) + len(row.encode()[:column].decode())


def merge_snippet(target: Path, snippet: Snippet) -> None:
    """Apply a settings.py/urls.py snippet to the project's file (see the module docstring)."""
    try:
        tree = ast.parse(snippet.code)
    except SyntaxError as exc:
        raise HostProjectError(f"snippet {snippet.name} is not Python: {exc}") from exc
    lines = snippet.code.splitlines()
    for node in tree.body:
        text = target.read_text()
        current = ast.parse(text)
        source = "\n".join(lines[node.lineno - 1 : node.end_lineno])  # the whole lines: comments kept
        if isinstance(node, ast.Import | ast.ImportFrom):
            if source.strip() in text.splitlines():
                continue
            imports = [n for n in current.body if isinstance(n, ast.Import | ast.ImportFrom)]
            after = imports[-1].end_lineno if imports else 0
            rows = text.splitlines(keepends=True)
            target.write_text("".join([*rows[:after], source + "\n", *rows[after:]]))
        elif _has_ellipsis(node):
            if not (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.List)
                and node.value.elts
                and isinstance(node.value.elts[0], ast.Constant)
                and node.value.elts[0].value is Ellipsis
                and not any(_has_ellipsis(e) for e in node.value.elts[1:])
            ):
                raise HostProjectError(
                    f"snippet {snippet.name}, line {node.lineno}: a `...` placeholder other than "
                    f"`NAME = [..., items]`: cannot apply {source.strip()!r}"
                )
            name = node.targets[0].id
            existing = _list_assignment(current, name)
            if existing is None or existing.end_lineno is None or existing.end_col_offset is None:
                raise HostProjectError(
                    f"snippet {snippet.name}: {name} = [..., ...] but {target.name} has no list {name} to extend"
                )
            items = [ast.get_source_segment(snippet.code, e) for e in node.value.elts[1:]]
            close = _offset(text, existing.end_lineno, existing.end_col_offset) - 1  # the `]`
            before = text[:close].rstrip()
            comma = "" if before.endswith((",", "[")) else ","
            added = "".join(f"    {item},\n" for item in items)
            target.write_text(f"{before}{comma}\n{added}{text[close:]}")
        else:
            target.write_text(text.rstrip("\n") + "\n\n" + source + "\n")
    try:
        ast.parse(target.read_text())
    except SyntaxError as exc:
        raise HostProjectError(f"{target} after snippet {snippet.name} is not Python: {exc}") from exc


def apply_guide(guide: Guide, site: Path) -> None:
    package = site / PROJECT
    files = [s for s in guide.snippets if s.path is not None]
    for wanted in (*MERGED_FILES, "asgi.py", f"{APP}/workflows.py"):
        if not any(s.path == wanted for s in files):
            raise HostProjectError(f"{GUIDE.relative_to(ROOT)}: no `# {wanted}` snippet")
    for snippet in files:
        assert snippet.path is not None
        if Path(snippet.path).name in PROJECT_FILES:
            target = package / Path(snippet.path).name
        else:
            target = site / snippet.path
        if Path(snippet.path).name in MERGED_FILES:
            merge_snippet(target, snippet)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            for folder in target.relative_to(site).parents:
                if folder != Path(".") and not (site / folder / "__init__.py").exists():
                    (site / folder / "__init__.py").write_text("")
            target.write_text(snippet.code)
        print(f"  applied {snippet.name}")


# --- the wheel and the virtualenvs ----------------------------------------------------------


def run(command: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None, what: str) -> str:
    """Run to completion; its output on failure, named."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HostProjectError(
            f"{what} failed (exit {done.returncode}): {' '.join(command)}\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
        )
    return done.stdout


def build_wheel() -> Path:
    source, dist = VAR / "src", VAR / "dist"
    shutil.rmtree(source, ignore_errors=True)
    shutil.rmtree(dist, ignore_errors=True)
    listed = run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], what="listing the tree's files"
    )
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_file():  # a deleted, not yet committed file is still listed
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(dist), "--cache-dir", str(PIP_CACHE), "-q"],
        cwd=source,
        what="pip wheel .",
    )
    (wheel,) = dist.glob("*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    missing = [
        name
        for name in filter(None, listed.split("\0"))
        if name.split("/")[0] in PACKAGES
        and (ROOT / name).is_file()
        and "/".join([PACKAGES[name.split("/")[0]], *name.split("/")[1:]]) not in packaged
    ]
    if missing:
        raise HostProjectError(f"{wheel.name} lacks files of the packages (pyproject.toml's package data?): {missing}")
    print(f"  built {wheel.relative_to(ROOT)} ({len(packaged)} files, every file of {' and '.join(PACKAGES.values())})")
    return wheel


def venv_key(python: str, constraints: Path, extras: str) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = run([python, "-c", "import sys; print(sys.version)"], what=f"{python} --version")
    digest = hashlib.sha256()
    for part in (
        version,
        constraints.read_text(),
        extras,
        json.dumps(project["dependencies"]),
        json.dumps(project["optional-dependencies"]),
    ):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:12]


def pip_constraints(label: str, pins: Path) -> Path:
    """`pins` as a constraints file: pip refuses extras there (`psycopg[binary]==...`)."""
    text = re.sub(r"^([\w.-]+)\[[\w,-]+\]", r"\1", pins.read_text(), flags=re.MULTILINE)
    constraints = VAR / f"constraints-{label}.txt"
    constraints.write_text(f"# {pins.name}, extras dropped (.ci/host_project.py)\n{text}")
    return constraints


def venv_for(label: str, python: str, pins: Path, extras: str, wheel: Path) -> Path:
    constraints = pip_constraints(label, pins)
    venv = VAR / f"venv-{label}-{venv_key(python, constraints, extras)}"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--cache-dir", str(PIP_CACHE)]
    if not (venv / ".installed").exists():
        for stale in VAR.glob(f"venv-{label}-*"):
            shutil.rmtree(stale)
        print(f"  creating {venv.relative_to(ROOT)} ({python}, constraints {pins.name})")
        run([python, "-m", "venv", str(venv)], what="python -m venv")
        run(
            [*pip, "install", "-q", "--constraint", str(constraints), f"{wheel}[{extras}]"],
            what=f"installing the wheel with [{extras}]",
        )
        (venv / ".installed").write_text(f"{wheel.name}[{extras}] -c {pins.name}\n")
    else:
        print(f"  reusing {venv.relative_to(ROOT)}")
    run([*pip, "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], what="reinstalling the wheel")
    return venv


# --- the host project's processes -----------------------------------------------------------


class Processes:
    """The long-running processes of one host project, each in its own session, stopped on exit."""

    def __init__(self, site: Path, env: dict[str, str]) -> None:
        self.site, self.env = site, env
        self.started: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.one_shot: set[str] = set()  # not expected to keep running

    def start(self, name: str, command: list[str], *, one_shot: bool = False) -> subprocess.Popen[bytes]:
        log = self.site / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, cwd=self.site, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started.append((name, process, log))
        if one_shot:
            self.one_shot.add(name)
        return process

    def check_alive(self) -> None:
        for name, process, log in self.started:
            if name not in self.one_shot and process.poll() is not None:
                raise HostProjectError(f"{name} exited ({process.returncode}); its log:\n{tail(log)}")

    def stop(self) -> None:
        for _, process, _ in self.started:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, process, _ in self.started:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def tail(log: Path, size: int = 3000) -> str:
    return log.read_text(errors="replace")[-size:] if log.exists() else "(no log)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, processes: Processes) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        processes.check_alive()
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise HostProjectError(f"nothing listens on port {port} after {TIMEOUT_S:.0f} s")


# The guide's start snippet runs first, in `manage.py shell`; this then waits for its `run`.
WAIT_FOR_RUN = """
import json, sys, time
import durable_flow
from django.urls import reverse
from durable_flow import get_run

assert durable_flow.__file__.startswith(sys.prefix), f"durable_flow from {durable_flow.__file__}, not the venv"
# A CEL key compiles and evaluates: its bindings came with the wheel's declared dependencies.
from durable_flow.definitions.cel import compile_cel, evaluate_cel
assert evaluate_cel(compile_cel('"tenant:" + input.t'), input={"t": "acme"}) == "tenant:acme", "a CEL key"
deadline = time.monotonic() + __TIMEOUT_S__
run = get_run(run.id)
while run.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
    time.sleep(0.5)
    run = get_run(run.id)
print("HOSTPROJECT " + json.dumps({
    "id": run.id, "status": run.status, "output": run.output,
    "admin_url": reverse("admin:durable_flow_workflowrun_change", args=[run.pk]),
    "run_url": reverse("dashboard:run", args=[run.id]),
    "index_url": reverse("dashboard:index"),
}))
"""


class Browser:
    """A cookie-keeping HTTP client that logs in through the admin's login form."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str) -> tuple[int, str]:
        try:
            with self.opener.open(self.base + path, timeout=TIMEOUT_S) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def login(self, username: str, password: str) -> None:
        status, page = self.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        if status != 200 or not token:
            raise HostProjectError(f"GET /admin/login/: {status}, no CSRF token\n{page[:2000]}")
        form = {"csrfmiddlewaretoken": token.group(1), "username": username, "password": password, "next": "/admin/"}
        request = urllib.request.Request(
            self.base + "/admin/login/",
            data=urllib.parse.urlencode(form).encode(),
            headers={"Referer": self.base + "/admin/login/"},
        )
        with self.opener.open(request, timeout=TIMEOUT_S) as response:
            if not response.url.endswith("/admin/"):
                raise HostProjectError(f"the admin login did not land on /admin/ but {response.url}")


def check_live_socket(port: int, browser: Browser) -> None:
    """The dashboard's WebSocket through the guide's asgi.py: a 101, then a first tick (a text
    frame the channel layer carried), with the logged-in session's cookie."""
    cookie = "; ".join(f"{c.name}={c.value}" for c in browser.jar)
    key = base64.b64encode(os.urandom(16)).decode()
    origin = f"http://127.0.0.1:{port}"
    request = (
        "GET /ws/live/?topic=overview HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\nOrigin: {origin}\r\nCookie: {cookie}\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(request.encode())
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
        head, _, rest = received.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].decode(errors="replace")
        if " 101 " not in f"{status} ":
            raise HostProjectError(f"WebSocket /ws/live/: {status!r}, not 101 Switching Protocols")

        def take(size: int) -> bytes:
            nonlocal rest
            while len(rest) < size:
                chunk = sock.recv(65536)
                if not chunk:
                    raise HostProjectError("WebSocket /ws/live/: closed before its first frame")
                rest += chunk
            taken, rest = rest[:size], rest[size:]
            return taken

        first, second = take(2)
        length = second & 0x7F
        if length == 126:
            length = int.from_bytes(take(2))
        elif length == 127:
            length = int.from_bytes(take(8))
        payload = take(length)
    if first & 0x0F != 1:  # a close frame (opcode 8) is the consumer refusing
        raise HostProjectError(f"WebSocket /ws/live/: first frame opcode {first & 0x0F}, not text: {payload[:200]!r}")
    print(f"  WebSocket /ws/live/?topic=overview: 101, first tick ({length} bytes)")


def check_page(browser: Browser, path: str, must_contain: str | None, what: str) -> None:
    status, page = browser.get(path)
    if status != 200:
        raise HostProjectError(f"GET {path} ({what}): HTTP {status}\n{page[:3000]}")
    if must_contain is not None and must_contain not in page:
        raise HostProjectError(f"GET {path} ({what}): 200 but without {must_contain!r}")
    print(f"  GET {path} ({what}): 200{', has the run id' if must_contain else ''}")


@contextlib.contextmanager
def stopping(processes: Processes) -> Iterator[Processes]:
    """Stop the processes however the block ends, SIGTERM/SIGINT/SIGHUP to this script included."""

    def interrupted(signum: int, frame: object) -> None:
        raise HostProjectError(f"interrupted by signal {signum}")

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield processes
    finally:
        processes.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def host_project(label: str, python: str, constraints: Path, guide: Guide, wheel: Path) -> None:
    extras = guide_extras(guide)
    venv = venv_for(label, python, constraints, extras, wheel)
    bin_dir = venv / "bin"
    site = VAR / f"site-{label}"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1", DJANGO_SUPERUSER_PASSWORD=PASSWORD)
    django = run([str(bin_dir / "python"), "-c", "import django; print(django.get_version())"], what="Django's version")
    print(f"  Django {django.strip()} in {venv.relative_to(ROOT)}")

    run([str(bin_dir / "django-admin"), "startproject", PROJECT, str(site)], env=env, what="django-admin startproject")
    apply_guide(guide, site)
    manage = [str(bin_dir / "python"), "manage.py"]
    for command, what in (
        (["check", "--fail-level", "WARNING"], "manage.py check"),
        (["migrate", "--noinput"], "manage.py migrate"),
        (["createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.com"], "createsuperuser"),
    ):
        run([*manage, *command], cwd=site, env=env, what=what)
    print("  check (no warning), migrate, createsuperuser: ok")

    for needed in (r"manage\.py durable_worker", r"manage\.py durable_poller"):
        guide_command(guide, needed)
    daphne = guide_command(guide, r"^daphne ").split()
    port = free_port()
    with stopping(Processes(site, env)) as processes:
        processes.start("durable_worker", [*manage, "durable_worker"])
        processes.start("durable_poller", [*manage, "durable_poller"])
        processes.start("daphne", [str(bin_dir / daphne[0]), "-b", "127.0.0.1", "-p", str(port), *daphne[1:]])

        snippet = start_snippet(guide)
        shell = processes.start(
            "shell",
            [*manage, "shell", "-c", snippet.code + WAIT_FOR_RUN.replace("__TIMEOUT_S__", str(TIMEOUT_S))],
            one_shot=True,
        )
        deadline = time.monotonic() + 2 * TIMEOUT_S  # the shell's own wait, and its start-up
        while shell.poll() is None:
            processes.check_alive()
            if time.monotonic() > deadline:
                raise HostProjectError(
                    f"manage.py shell still running after {2 * TIMEOUT_S:.0f} s:\n{tail(site / 'shell.log')}"
                )
            time.sleep(0.5)
        log = site / "shell.log"
        found = re.search(r"^HOSTPROJECT (.*)$", log.read_text(), re.MULTILINE)
        if shell.returncode != 0 or not found:
            raise HostProjectError(f"the start snippet {snippet.name} in manage.py shell failed:\n{tail(log)}")
        result = json.loads(found.group(1))
        if result["status"] != "completed":
            raise HostProjectError(
                f"run {result['id']} is {result['status']!r}, not completed, after {TIMEOUT_S:.0f} s; "
                f"worker log:\n{tail(site / 'durable_worker.log')}"
            )
        print(f"  run {result['id']} completed: {result['output']!r}")

        wait_for_port(port, processes)
        browser = Browser(f"http://127.0.0.1:{port}")
        browser.login("admin", PASSWORD)
        check_page(browser, result["index_url"], None, "the dashboard")
        check_page(browser, result["run_url"], result["id"], "the dashboard's run page")
        check_page(browser, result["admin_url"], result["id"], "the admin's run page")
        check_live_socket(port, browser)
        processes.check_alive()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["5.2", "6"], help="one Django version")
    parser.add_argument("--python-django52", default="python3.11", help="a Python 3.11 (default python3.11)")
    parser.add_argument("--python-django6", default="", help="a Python >= 3.12 (Makefile: PYTHON_DJANGO6)")
    args = parser.parse_args()
    versions = {
        "5.2": (args.python_django52, ROOT / "requirements.lock"),
        "6": (args.python_django6, ROOT / "requirements-django6.txt"),
    }
    VAR.mkdir(parents=True, exist_ok=True)
    verdicts: dict[str, str] = {}
    started = time.monotonic()
    try:
        guide = read_guide()
        print("== host project: building the wheel")
        wheel = build_wheel()
    except HostProjectError as exc:
        print(f"FAIL host project: {exc}")
        return 1
    for label, (python, constraints) in versions.items():
        if args.only and args.only != label:
            continue
        began = time.monotonic()
        print(f"== host project on Django {label}")
        try:
            if not python:
                raise HostProjectError(f"no Python for Django {label} (see --python-django6)")
            host_project(label, python, constraints, guide, wheel)
        except HostProjectError as exc:
            verdicts[label] = f"FAIL host project on Django {label} ({time.monotonic() - began:.0f} s): {exc}"
        else:
            verdicts[label] = f"PASS host project on Django {label} ({time.monotonic() - began:.0f} s)"
        print(verdicts[label])
    print(f"== host project: {time.monotonic() - started:.0f} s in all")
    for verdict in verdicts.values():
        print(verdict.splitlines()[0])
    return 0 if all(v.startswith("PASS") for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
