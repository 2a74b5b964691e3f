"""The dashboard in a real browser: JupyterLab and Notebook 7 in headless Chromium, driven by Playwright.

The widget tests check the Python half of every view. This test checks the
other half, which only a browser runs: the ipywidgets and plotly front ends
load, the dashboard renders, and a click on **Step** or **Play** travels to
the kernel and comes back as a changed plot. It runs once in each front end a
learner may open the lessons in: JupyterLab (``make lab``) and Notebook 7.

1. copy ``tests/notebooks/browser_check.ipynb`` into a temporary folder and
   start the Jupyter server there on a free local port, with no token and with
   its own config, data and runtime folders (nothing from the user's setup leaks in);
2. open the notebook in Chromium (Debian's ``/usr/bin/chromium``; ``make
   browser-deps`` installs it), wait for its kernel, and run the front end's
   "Run All Cells" command (the one behind Run > Run All Cells);
3. wait for the dashboard's controls and plots, read the block-table plot's
   title (it names the step) and screenshot it;
4. click Step, wait for the title to move on by one step; click Play, wait
   for it to move further, then pause;
5. screenshots go to ``test-artifacts/browser/<front end>/``; the server and its
   kernel are always stopped, by process id, whatever happened.

If Chromium cannot start, the test fails and says how to install it: a
browser test that skips itself would pass in CI without testing anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "tests" / "notebooks" / "browser_check.ipynb"
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("KVPAGING_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_TIMEOUT = 60  # seconds
NOTEBOOK_TIMEOUT = 90  # seconds for all cells to run and the dashboard to render
CLICK_TIMEOUT = 30  # seconds for a click to come back as a redrawn plot

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"JupyterLab exited with code {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "api/status", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"JupyterLab did not answer within {SERVER_START_TIMEOUT} s:\n{log.read_text()[-3000:]}")


def pids_using(path: Path) -> list[int]:
    """Processes whose command line mentions ``path``: the kernels this test's server started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(path) in cmdline:
                pids.append(int(entry.name))
    return pids


# The two front ends a learner or teacher opens the lessons in: JupyterLab (``make lab``) and
# Notebook 7 (the classic one-notebook-per-tab interface, rebuilt on JupyterLab's components).
FRONT_ENDS = {
    "jupyterlab": (["jupyterlab", "--LabApp.news_url=", "--LabApp.extension_manager=readonly",
                    "--LabApp.expose_app_in_browser=True"], "lab/tree/{name}?reset"),
    "notebook7": (["notebook", "--JupyterNotebookApp.expose_app_in_browser=True"], "notebooks/{name}"),
}


@contextlib.contextmanager
def jupyterlab_server(workdir: Path, front_end: str = "jupyterlab"):
    """A Jupyter server (JupyterLab or Notebook 7) on a free port serving a copy of the test notebook;
    always stopped afterwards.

    Yields (base url, log file). Its config, data, runtime, settings and
    workspace folders all live under ``workdir``.
    """
    root = workdir / "notebooks"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    home = workdir / "jupyter"
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
        IPYTHONDIR=str(home / "ipython"),
        PYTHONUNBUFFERED="1",
    )
    # no "would you like news?" toast, no update check: nothing that talks to the internet
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                          "checkForUpdates": False}))
    # start the notebook's kernel on opening, without a "Select Kernel" dialog
    tracker = home / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"autoStartDefaultKernel": True}))
    port = free_port()
    log = workdir / "jupyterlab.log"
    module, *app_options = FRONT_ENDS[front_end][0]
    command = [
        sys.executable, "-m", module, "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        f"--ServerApp.root_dir={root}", "--IdentityProvider.token=", "--ServerApp.password=",
        "--ServerApp.disable_check_xsrf=True", "--ServerApp.terminals_enabled=False", *app_options,
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # containers and CI machines often run as root
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for_server(url, process, log)
        yield url, log
    finally:
        # ask the server to stop (it shuts its kernels down), then make sure, by process id
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.send_signal(signal.SIGINT)  # jupyter asks "shut down? (y/n)" after the first one
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        for pid in pids_using(home / "runtime"):  # a kernel left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert process.poll() is not None, "the JupyterLab server is still running"


@pytest.fixture(params=list(FRONT_ENDS))
def jupyterlab(request, tmp_path):
    with jupyterlab_server(tmp_path, request.param) as (url, log):
        yield url, log, request.param


def launch_chromium(playwright, user_data_dir: Path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: run `make browser-deps` "
                    "(apt-get install -y chromium), or point KVPAGING_CHROMIUM at a Chromium binary")
    try:
        return playwright.chromium.launch_persistent_context(
            str(user_data_dir), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1600, "height": 1400},
        )
    except Exception as error:  # noqa: BLE001 - turn any launch problem into a clear failure
        pytest.fail(f"Chromium at {CHROMIUM} could not start: {error}\n"
                    "Install or repair it with `make browser-deps` (Debian's chromium package).")


def block_table_title(page) -> str:
    """The block-table plot's title: it names the step the dashboard shows."""
    return page.locator(".kvpaging-dashboard .js-plotly-plot .gtitle").first.text_content() or ""


def wait_for_title_change(page, old: str, what: str) -> str:
    deadline = time.monotonic() + CLICK_TIMEOUT
    while time.monotonic() < deadline:
        title = block_table_title(page)
        if title and title != old:
            return title
        page.wait_for_timeout(200)
    pytest.fail(f"{what}: the block-table plot did not change within {CLICK_TIMEOUT} s (still {old!r})")


def wait_until_still(page, what: str, still_ms: int = 1000) -> str:
    """The block-table title once it has not changed for ``still_ms``."""
    deadline = time.monotonic() + CLICK_TIMEOUT
    title, since = block_table_title(page), time.monotonic()
    while time.monotonic() < deadline:
        page.wait_for_timeout(200)
        now = block_table_title(page)
        if now != title:
            title, since = now, time.monotonic()
        elif time.monotonic() - since >= still_ms / 1000:
            return title
    pytest.fail(f"{what}: the block-table plot kept changing for {CLICK_TIMEOUT} s (now {title!r})")


KERNEL_READY = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session
        && panel.sessionContext.session.kernel;
    return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""


def run_all_and_wait(page) -> None:
    """Wait for the last cell's printout; accept a kernel dialog should JupyterLab still ask for one."""
    done = page.locator(".jp-OutputArea-output", has_text="browser-check: ran")
    select = page.locator(".jp-Dialog button", has_text="Select")
    deadline = time.monotonic() + NOTEBOOK_TIMEOUT
    while time.monotonic() < deadline:
        if done.count():
            return
        if select.count() and select.first.is_visible():
            select.first.click()
        if page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']").count():
            pytest.fail("a notebook cell raised:\n" + page.locator(".jp-OutputArea").last.inner_text())
        page.wait_for_timeout(250)
    pytest.fail(f"the notebook did not finish within {NOTEBOOK_TIMEOUT} s")


def step_number(title: str) -> int:
    return int(title.split("after step ")[1].split(":")[0])


def test_dashboard_step_and_play_in_the_browser(jupyterlab, tmp_path):
    try:
        from playwright import sync_api
    except ImportError as error:  # fail, not skip: a skipped browser test would pass CI untested
        pytest.fail(f"Playwright is missing ({error}): pip install -e '.[test]'")
    url, log, front_end = jupyterlab
    artifacts = ARTIFACTS / front_end
    artifacts.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright, tmp_path / "chromium-profile")
        try:
            page = browser.new_page()
            page.set_default_timeout(NOTEBOOK_TIMEOUT * 1000)
            page.goto(url + FRONT_ENDS[front_end][1].format(name=NOTEBOOK.name))
            page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell")
            # the server exposes the app (expose_app_in_browser): wait for a connected, idle kernel,
            # then run JupyterLab's own "Run All Cells" command, as the Run menu would
            page.wait_for_function(KERNEL_READY)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            run_all_and_wait(page)

            # the dashboard: controls and five plots drawn by plotly.js
            page.wait_for_selector(".kvpaging-dashboard .kvpaging-controls")
            page.wait_for_function(
                "document.querySelectorAll('.kvpaging-dashboard .js-plotly-plot .main-svg').length >= 5")
            plot = page.locator(".kvpaging-dashboard .js-plotly-plot").first
            before = wait_for_title_change(page, "", "first render")
            page.wait_for_timeout(300)
            plot.screenshot(path=str(artifacts / "1-before.png"))
            page.screenshot(path=str(artifacts / "1-dashboard.png"), full_page=True)
            assert step_number(before) == 1, before
            image_before = hashlib.sha256(plot.screenshot()).hexdigest()

            page.locator(".kvpaging-dashboard .kvpaging-controls button", has_text="Step").first.click()
            after_step = wait_for_title_change(page, before, "after Step")
            assert step_number(after_step) == 2, after_step
            page.wait_for_timeout(300)
            plot.screenshot(path=str(artifacts / "2-after-step.png"))
            assert hashlib.sha256(plot.screenshot()).hexdigest() != image_before

            # ipywidgets 8's Play widget: the first button plays, and pauses while playing
            play_button = page.locator(".kvpaging-dashboard .kvpaging-controls .widget-play button").first
            play_button.click()
            after_play = wait_for_title_change(page, after_step, "after Play")
            assert step_number(after_play) > 2, after_play
            play_button.click()  # pause
            # frames the kernel drew before the click may still arrive (a loaded machine lags): wait until the
            # title holds still, then check that it stays, and that playing stopped before the last step
            paused_at = wait_until_still(page, "after Pause")
            page.wait_for_timeout(1000)
            assert block_table_title(page) == paused_at, "the dashboard kept moving after Pause"
            ran = page.locator(".jp-OutputArea-output", has_text="browser-check: ran").first.text_content()
            num_steps = int(ran.split("browser-check: ran")[1].split()[0])
            assert step_number(paused_at) < num_steps, f"Play reached the end ({paused_at}) before Pause was tested"
            page.wait_for_timeout(300)
            plot.screenshot(path=str(artifacts / "3-after-play.png"))
            page.screenshot(path=str(artifacts / "3-dashboard.png"), full_page=True)
        except BaseException:
            try:
                page.screenshot(path=str(artifacts / "failure.png"), full_page=True)
            except Exception:  # noqa: BLE001 - the screenshot is a courtesy; report the real error
                pass
            shutil.copy(log, artifacts / "jupyterlab.log")
            raise
        finally:
            browser.close()
    assert time.monotonic() - started < 120


def test_static_html_export_plays_offline(tmp_path):
    """A dashboard exported with to_html() animates in a browser with no server and no internet."""
    from kvpaging.visualizers import Dashboard
    from kvpaging.visualizers.examples import BLOCK_SIZE, hand_trace

    try:
        from playwright import sync_api
    except ImportError as error:
        pytest.fail(f"Playwright is missing ({error}): pip install -e '.[test]'")
    path = tmp_path / "dashboard.html"
    Dashboard.from_trace(hand_trace(), block_size=BLOCK_SIZE).to_html(path)  # plotly.js embedded
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright, tmp_path / "chromium-profile")
        try:
            page = browser.new_page()
            page.set_default_timeout(CLICK_TIMEOUT * 1000)
            page.goto(path.as_uri())
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 5")
            title = page.locator(".js-plotly-plot .gtitle").first
            assert title.text_content().startswith("Block tables after step 1")  # frames start at the first step
            page.locator(".updatemenu-button", has_text="Play").first.click()
            page.wait_for_function(
                "document.querySelector('.js-plotly-plot .gtitle').textContent.startsWith('Block tables after step 5')")
            page.screenshot(path=str(ARTIFACTS / "static-export.png"), full_page=True)
        finally:
            browser.close()
