"""The dashboard (/dashboard) and the setup wizard (/setup) in a real browser.

Debian's headless chromium, driven by Selenium through Debian's chromedriver, against
the real modelrelay-server and modelrelay-worker release binaries and two demo backends
(examples/demo_backend.rs: model `demo`, and model `late` for the worker that joins
while the page is open). Every step waits for a state (a row, a text, a process exit,
an /admin answer), never for a fixed time.

Run by tests/browser/run.sh; prints "browser: N passed, M failed" at the end.
"""

import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.path.join(ROOT, "target", "release")
ARTIFACTS = os.path.join(ROOT, "target", "browser-artifacts")
ADMIN = "browser-admin-token"
SECRET = "browser-worker-secret"
TARGET = "x86_64-unknown-linux-musl"
WAIT = 15  # upper bound for states that should come promptly; tests fail, not hang


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, probe, timeout=WAIT):
    """Polls `probe` until it returns something truthy; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except Exception as e:  # the state is not there yet
            last = e
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last saw {last!r}")


class Stack:
    """Demo backends, the relay and its workers, each a child process with a log."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="mr-browser-")
        self.procs = []
        self.downloads = os.path.join(self.tmp, "downloads")
        os.makedirs(self.downloads)
        self.binary = b"not really a worker binary, but bytes with a checksum\n" * 100
        with open(os.path.join(self.downloads, "modelrelay-worker-" + TARGET), "wb") as f:
            f.write(self.binary)
        self.backend = self.spawn("backend", [os.path.join(BIN, "examples", "demo_backend")],
                                  {"DEMO_BACKEND_ADDR": f"127.0.0.1:{free_port()}"}, wait_line="demo backend serving")
        self.backend_url = "http://" + self.line_addr("backend")
        self.late_backend = self.spawn("late-backend", [os.path.join(BIN, "examples", "demo_backend")],
                                       {"DEMO_BACKEND_ADDR": f"127.0.0.1:{free_port()}", "DEMO_MODEL": "late"},
                                       wait_line="demo backend serving")
        self.late_backend_url = "http://" + self.line_addr("late-backend")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = self.spawn("server", [os.path.join(BIN, "modelrelay-server")], {
            "WORKER_SECRET": SECRET,
            "MODELRELAY_ADMIN_TOKEN": ADMIN,
            "STATE_DIR": os.path.join(self.tmp, "state"),
            "WORKER_DOWNLOAD_DIR": self.downloads,
            "LISTEN_ADDR": f"127.0.0.1:{port}",
        }, wait_line="listening on")
        self.workers = {}

    def spawn(self, name, argv, env, wait_line=None):
        log = open(os.path.join(self.tmp, name + ".log"), "w+")
        full_env = dict(os.environ, LOG_LEVEL="info", **env)
        proc = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        proc.log_path = log.name
        self.procs.append(proc)
        if wait_line:
            wait_for(f"{name} to say '{wait_line}'", lambda: wait_line in self.log(name))
        return proc

    def log(self, name):
        with open(os.path.join(self.tmp, name + ".log")) as f:
            return f.read()

    def line_addr(self, name):
        line = next(l for l in self.log(name).splitlines() if "http://" in l)
        return line.split("http://", 1)[1].split()[0]

    def start_worker(self, name, backend_url, slots=1, env=None):
        env = env or {
            "PROXY_URL": self.url,
            "WORKER_SECRET": SECRET,
            "BACKEND_URL": backend_url,
            "WORKER_NAME": name,
            "MAX_CONCURRENCY": str(slots),
        }
        proc = self.spawn("worker-" + name, [os.path.join(BIN, "modelrelay-worker")], env)
        self.workers[name] = proc
        return proc

    def admin(self, method, path, body=None):
        req = urllib.request.Request(self.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"authorization": "Bearer " + ADMIN, "content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def admin_worker(self, name):
        return next((w for w in self.admin("GET", "/admin/workers")["workers"] if w["name"] == name), None)

    def status_of(self, method, path, headers=None, data=None):
        req = urllib.request.Request(self.url + path, method=method, headers=headers or {}, data=data)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def chat(self, model, stream=False, scenario=None):
        body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hello"}]}
        if scenario:
            body["scenario"] = scenario
        # Compact separators: the demo backend looks for the literal "scenario":"...".
        data = json.dumps(body, separators=(",", ":")).encode()
        conn = http.client.HTTPConnection("127.0.0.1", int(self.url.rsplit(":", 1)[1]), timeout=30)
        conn.request("POST", "/v1/chat/completions", body=data, headers={"content-type": "application/json"})
        return conn, conn.getresponse()

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def browser():
    opts = Options()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000",
                "--disable-gpu", "--no-first-run", "--disable-extensions"]:
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    return webdriver.Chrome(service=service, options=opts)


class Suite:
    def __init__(self, stack):
        self.s = stack
        self.d = browser()
        self.console = []  # every browser log entry seen, for the console check

    # ---- helpers ----
    def logs(self):
        entries = self.d.get_log("browser")
        self.console.extend(entries)
        return entries

    def severe(self, entries):
        return [e for e in entries if e.get("level") == "SEVERE"]

    def find(self, css):
        return self.d.find_element(By.CSS_SELECTOR, css)

    def text_of(self, css):
        # The page re-renders live: an element found a moment ago may have been
        # replaced by the time its text is read, so find it again.
        for _ in range(20):
            try:
                return self.d.find_element(By.CSS_SELECTOR, css).text
            except StaleElementReferenceException:
                continue
        return self.d.find_element(By.CSS_SELECTOR, css).text

    def settle(self):
        """Waits until the page is at rest: the same scroll position over two animation
        frames. A click is aimed at where the element is when the click starts; while the
        page still scrolls (the wizard scrolls smoothly to its commands) the element moves
        away under the pointer and the click lands on something else, silently."""
        still = """const done = arguments[arguments.length - 1];
            const at = () => window.scrollX + ',' + window.scrollY;
            const first = at();
            requestAnimationFrame(() => requestAnimationFrame(() => done(at() === first)));"""
        wait_for("the page at rest (not scrolling)", lambda: self.d.execute_async_script(still))

    def click(self, css):
        """Clicks `css` once the page is at rest, finding it afresh (the live page may have
        replaced the element found a moment ago)."""
        self.settle()
        WebDriverWait(self.d, WAIT, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda d: d.find_element(By.CSS_SELECTOR, css).click() or True, message=f"a click on {css}")

    def choose(self, css):
        """Picks the radio button `css` and waits until the page has it checked."""
        self.click(css)
        WebDriverWait(self.d, WAIT, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda d: d.find_element(By.CSS_SELECTOR, css).is_selected(), message=f"{css} checked")

    def wait_text(self, css, pred, what, timeout=WAIT):
        """Waits until the text of `css` satisfies `pred`; returns that text."""
        def probe(d):
            text = d.find_element(By.CSS_SELECTOR, css).text
            return text if pred(text) else None
        return WebDriverWait(self.d, timeout, poll_frequency=0.05,
                             ignored_exceptions=(StaleElementReferenceException,)).until(probe, message=what)

    def accept_confirm(self):
        WebDriverWait(self.d, WAIT).until(EC.alert_is_present(), message="a confirmation")
        self.d.switch_to.alert.accept()

    def sign_in(self, token):
        self.d.get(self.s.url + "/dashboard")
        field = WebDriverWait(self.d, WAIT).until(EC.presence_of_element_located((By.ID, "token")))
        field.clear()
        field.send_keys(token)
        self.click("#signin")

    def screenshot(self, name, width=1280):
        self.d.execute_script("window.scrollTo(0, 0)")
        height = self.d.execute_script("return document.documentElement.scrollHeight")
        self.d.set_window_size(width, min(max(height + 40, 800), 4000))
        path = os.path.join(ARTIFACTS, name)
        self.d.save_screenshot(path)
        self.d.set_window_size(1280, 1000)
        print(f"  screenshot: {os.path.relpath(path, ROOT)}")

    # ---- the cases, in order (later ones use the session of the sign-in) ----
    def test_signed_out_browser_gets_no_data(self):
        self.d.get(self.s.url + "/dashboard")
        WebDriverWait(self.d, WAIT).until(EC.presence_of_element_located((By.ID, "token")))
        page = self.d.page_source
        assert 'id="workers"' not in page and "demo-worker" not in page, "the sign-in page shows data"
        assert self.d.find_elements(By.ID, "live") == []
        for method, path in [("GET", "/dashboard/events"), ("POST", "/dashboard/api/models/refresh"),
                             ("POST", "/dashboard/api/keys")]:
            status = self.s.status_of(method, path, headers={"origin": self.s.url}, data=b"{}" if method == "POST" else None)
            assert status == 401, f"{method} {path} without a session: {status}"
        info = json.loads(urllib.request.urlopen(self.s.url + "/setup/info").read())
        assert info["signed_in"] is False and info["worker_secret"] is None, info
        self.screenshot("signin.png")
        assert not self.severe(self.logs()), self.console

    def test_sign_in(self):
        self.sign_in("wrong-token")
        self.wait_text("#signin-error", lambda t: "wrong" in t, "the refusal on the sign-in page")
        self.logs()  # the 401 of the refused form is expected in the console: set aside
        self.console.clear()
        self.sign_in(ADMIN)
        self.wait_text("#live", lambda t: t == "live", "the live feed")
        cookie = self.d.get_cookie("modelrelay_session")
        assert cookie and cookie["httpOnly"] and cookie.get("sameSite") == "Strict", cookie
        assert self.d.execute_script("return document.cookie") == "", "the session cookie is visible to scripts"
        self.wait_text('#workers tr[data-name="demo-worker"] .slots', lambda t: t == "0 / 1", "demo-worker listed")
        # A worker with one relay reports no others.
        self.wait_text('#workers tr[data-name="demo-worker"] .relays', lambda t: t == "this one", "its relays column")

    def test_worker_appears_and_its_slots_move(self):
        self.s.start_worker("late-worker", self.s.late_backend_url, slots=2)
        wait_for("late-worker registered", lambda: self.s.admin_worker("late-worker"))
        registered = time.monotonic()
        row = '#workers tr[data-name="late-worker"]'
        # The figure (the page should show it within 2 s; the feed publishes every 250 ms) is
        # printed, not asserted: a loaded CI machine must not turn a timing into a failure.
        self.wait_text(row + " .slots", lambda t: t == "0 / 2", "late-worker on the page")
        print(f"  late-worker on the page {1000 * (time.monotonic() - registered):.0f} ms after it registered")
        conn, resp = self.s.chat("late", stream=True, scenario="hang")
        assert resp.status == 200, resp.status
        resp.fp.readline()  # the first chunk's size line: the request is running on the worker
        self.wait_text(row + " .slots", lambda t: t == "1 / 2", "a busy slot while the request runs")
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        self.wait_text(row + " .slots", lambda t: t == "0 / 2", "the slot freed after the client left")
        assert not self.severe(self.logs()), self.console

    def test_drain_from_the_page_reaches_the_worker(self):
        button = '#workers tr[data-name="late-worker"] button.drain'
        assert self.find(button).get_attribute("aria-label") == "Drain late-worker"
        self.click(button)
        self.accept_confirm()
        self.wait_text("#msg", lambda t: "Draining late-worker" in t, "the drain acknowledged")
        worker = self.s.workers["late-worker"]
        code = wait_for("late-worker to exit after its drain", lambda: worker.poll() is not None or None)
        assert worker.returncode == 0, f"worker exit {worker.returncode}"
        assert "drain" in self.s.log("worker-late-worker").lower(), self.s.log("worker-late-worker")
        WebDriverWait(self.d, WAIT).until(
            lambda d: not d.find_elements(By.CSS_SELECTOR, '#workers tr[data-name="late-worker"]'),
            message="late-worker gone from the page")
        del code
        assert not self.severe(self.logs()), self.console

    def test_key_create_shows_the_secret_once_and_revoke(self):
        self.find("#key-name").send_keys("browser-key")
        self.find("#key-tenant").send_keys("team-a")
        self.click("#key-create")
        self.accept_confirm()
        box = WebDriverWait(self.d, WAIT).until(EC.visibility_of_element_located((By.ID, "new-key")))
        secret = self.find("#new-key-secret").get_attribute("value")
        assert secret.startswith("mr-") and len(secret) > 20, secret
        keys = self.s.admin("GET", "/admin/keys")["keys"]
        key = next(k for k in keys if k["name"] == "browser-key")
        assert key["tenant"] == "team-a" and not key["revoked"], key
        row = f'#keys tr[data-name="browser-key"]'
        self.wait_text(row + " td:nth-of-type(5)", lambda t: t == "active", "the key listed as active")
        self.click("#new-key-done")
        assert not box.is_displayed()
        self.d.refresh()
        self.wait_text("#live", lambda t: t == "live", "the feed after a reload")
        self.wait_text(row + " td:nth-of-type(5)", lambda t: t == "active", "the key after a reload")
        assert secret not in self.d.page_source, "the secret is shown again"
        self.click(row + " button.revoke")
        self.accept_confirm()
        self.wait_text(row + " td:nth-of-type(5)", lambda t: t == "revoked", "the key shown revoked")
        key = next(k for k in self.s.admin("GET", "/admin/keys")["keys"] if k["id"] == key["id"])
        assert key["revoked"], key
        assert not self.severe(self.logs()), self.console

    def test_dashboard_shows_traffic(self):
        for n in range(6):
            conn, resp = self.s.chat("demo", stream=n % 2 == 0)
            resp.read()
            conn.close()
        bad = self.s.status_of("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                               data=b"this is not json")
        assert bad == 400, bad
        self.wait_text("#recent tbody", lambda t: t.count("demo") >= 6, "the recent requests")
        self.wait_text("#errors tbody", lambda t: "none" not in t, "an error reason")
        recent = self.text_of("#recent tbody")
        assert "hello" not in recent, "prompt text in the recent-requests table"
        self.wait_text("#c-ttft", lambda t: "ms" in t, "time to first token")
        assert self.d.find_elements(By.CSS_SELECTOR, "#chart-requests rect.ok"), "no bars in the requests chart"
        assert self.d.find_elements(By.CSS_SELECTOR, "#bars-model rect.tok"), "no token bars"
        self.screenshot("dashboard.png")
        self.screenshot("dashboard-phone.png", width=390)
        # The system's dark setting, as the page sees it through prefers-color-scheme.
        dark = {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
        self.d.execute_cdp_cmd("Emulation.setEmulatedMedia", dark)
        background = self.d.execute_script("return getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(17, 20, 24)", f"dark mode not applied: {background}"
        self.screenshot("dashboard-dark.png")
        self.d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
        assert not self.severe(self.logs()), self.console

    def test_wizard_live_check_turns_green(self):
        self.d.get(self.s.url + "/setup")
        WebDriverWait(self.d, WAIT).until(lambda d: d.find_element(By.ID, "backend-url").get_attribute("value"),
                                          message="the wizard ready")
        assert self.find("#signin-note").get_attribute("hidden") is not None, "signed in, yet told to sign in"
        self.choose('input[name="backend"][value="ollama"]')
        assert self.find("#backend-url").get_attribute("value") == "http://127.0.0.1:11434"
        # systemd: the unit, the env file with the secret, the enable command.
        name = self.find("#worker-name")
        name.clear()
        name.send_keys("wizard-box")
        url = self.find("#backend-url")
        url.clear()
        url.send_keys(self.s.backend_url)
        self.click("#show")
        env_block = WebDriverWait(self.d, WAIT).until(EC.visibility_of_element_located((By.ID, "cmd-env"))).text
        for line in [f"PROXY_URL={self.s.url}", f"WORKER_SECRET={SECRET}", "WORKER_NAME=wizard-box",
                     f"BACKEND_URL={self.s.backend_url}", "BACKEND_KIND=ollama", "MAX_CONCURRENCY=1", "MODELS=*"]:
            assert line in env_block, f"{line} not in {env_block}"
        run = self.text_of("#cmd-run")
        assert "systemctl enable --now modelrelay-worker@wizard-box" in run and "[Service]" in run, run
        sha = hashlib.sha256(self.s.binary).hexdigest()
        assert self.text_of("#download-sha") == sha
        assert sha in self.text_of("#cmd-download") and "sha256sum -c" in self.text_of("#cmd-download")
        got = urllib.request.urlopen(f"{self.s.url}/setup/download/{TARGET}")
        assert got.read() == self.s.binary and got.headers["x-checksum-sha256"] == sha
        self.wait_text("#check", lambda t: "Waiting for a worker named wizard-box" in t, "the live check waiting")
        # The plain command line: run exactly what it says (its env), with the real worker.
        # (Show scrolled the page to the commands; `choose` and `click` wait until it is at
        # rest and check that the choice took, so no click lands beside its target.)
        self.choose('input[name="run"][value="shell"]')
        self.click("#show")
        run = self.wait_text("#cmd-run", lambda t: "./modelrelay-worker" in t, "the command line")
        env = {}
        for line in run.splitlines():
            line = line.strip().rstrip("\\").strip()
            if "=" in line and line[0].isupper():
                key, value = line.split("=", 1)
                env[key] = value.strip("'")
        assert env["WORKER_SECRET"] == SECRET and env["PROXY_URL"] == self.s.url, env
        env["BACKEND_KIND"] = "auto"  # the demo backend speaks plain OpenAI, not Ollama
        self.s.start_worker("wizard-box", None, env=env)
        WebDriverWait(self.d, WAIT, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda d: d.find_element(By.ID, "check").get_attribute("data-state") == "connected",
            message="the live check turning green")
        self.wait_text("#check-models", lambda t: "demo" in t, "the live check listing the worker's models")
        self.screenshot("setup.png")
        assert not self.severe(self.logs()), self.console

    def test_wizard_sees_a_wrong_secret(self):
        self.choose('input[name="run"][value="shell"]')
        self.settle()
        name = self.find("#worker-name")
        name.clear()
        name.send_keys("bad-secret-box")
        self.click("#show")
        self.wait_text("#check", lambda t: "bad-secret-box" in t, "the check watching the new name")
        env = {"PROXY_URL": self.s.url, "WORKER_SECRET": "not-the-secret", "BACKEND_URL": self.s.backend_url,
               "WORKER_NAME": "bad-secret-box"}
        self.s.start_worker("bad-secret-box", None, env=env)
        WebDriverWait(self.d, WAIT).until(
            lambda d: d.find_element(By.ID, "check").get_attribute("data-state") == "wrong-secret",
            message="the live check explaining a wrong secret")
        self.s.workers["bad-secret-box"].terminate()
        assert not self.severe(self.logs()), self.console

    def test_sign_out_ends_the_session(self):
        cookie = self.d.get_cookie("modelrelay_session")["value"]
        self.d.get(self.s.url + "/dashboard")
        self.wait_text("#live", lambda t: t == "live", "the feed")
        self.click("#signout")
        WebDriverWait(self.d, WAIT).until(EC.presence_of_element_located((By.ID, "token")))
        assert self.d.get_cookie("modelrelay_session") is None
        status = self.s.status_of("GET", "/dashboard/events", headers={"cookie": "modelrelay_session=" + cookie})
        assert status == 401, f"the old session still reads the feed: {status}"
        assert "demo-worker" not in self.d.page_source
        assert not self.severe(self.logs()), self.console

    def close(self):
        self.d.quit()


def main():
    os.makedirs(ARTIFACTS, exist_ok=True)
    stack = Stack()
    suite = None
    passed, failed = 0, 0
    try:
        stack.start_worker("demo-worker", stack.backend_url)
        wait_for("demo-worker registered", lambda: stack.admin_worker("demo-worker"))
        suite = Suite(stack)
        cases = [getattr(suite, n) for n in Suite.__dict__ if n.startswith("test_")]
        only = sys.argv[1:]
        for case in cases:
            if only and not any(o in case.__name__ for o in only):
                continue
            started = time.monotonic()
            try:
                case()
                passed += 1
                print(f"ok     {case.__name__} ({time.monotonic() - started:.1f}s)", flush=True)
            except Exception:
                failed += 1
                print(f"FAILED {case.__name__}", flush=True)
                traceback.print_exc()
                try:
                    suite.d.save_screenshot(os.path.join(ARTIFACTS, f"failed-{case.__name__}.png"))
                except Exception:
                    pass
    except Exception:
        failed += 1
        traceback.print_exc()
    finally:
        if suite:
            suite.close()
        stack.stop()
        if failed:
            for name in sorted(os.listdir(stack.tmp)):
                if name.endswith(".log"):
                    print(f"---- {name} (tail)")
                    print("".join(stack.log(name[:-4]).splitlines(True)[-25:]))
        shutil.rmtree(stack.tmp, ignore_errors=True)
    print(f"browser: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
