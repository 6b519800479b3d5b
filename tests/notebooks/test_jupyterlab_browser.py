"""The interactive path as a user walks it: JupyterLab in headless Chromium runs a notebook at the ci profile.

JupyterLab is started on 127.0.0.1 (a free port, a token) as ``make lab`` starts it (``--notebook-dir=notebooks``),
in a temporary tree whose ``notebooks/`` holds a byte-for-byte copy of the committed ``02_memory_wall``, with the
kernelspec the Makefile installs (its ``--name`` and ``--display-name``, running this interpreter) in a temporary
``JUPYTER_DATA_DIR`` (with Jupyter's config, runtime and IPython directories), so no user's setup is read or
written. Chromium opens the notebook; the test checks that the tab is not marked modified once the kernel has
connected (JupyterLab rewrites ``metadata.language_info`` and ``kernelspec`` from the kernel: a notebook that does
not already hold them is dirty on opening), types ``ci`` over the parameters cell's ``"cpu"``, runs all cells from
the command palette and saves. It then checks the kernel name shown, that the kernel's imports left no deprecation
noise on screen, a rendered figure, the progress widget's text, no error output, the saved file's outputs, the
result file, the W&B offline run, the executed notebook the kernel recorded as evidence (as papermill's would be),
and what git would commit: the saved file through the Makefile's clean filter (``nbstripout --keep-id``) is the
committed notebook with that one edit and nothing else (no outputs, no metadata JupyterLab added). Screenshots
(opened, the running cell, the progress widget, a figure, done), the progress text and the page's stderr text go
to the test's tmp folder.

Skipped, with its reason, where no browser is installed: Debian's ``chromium`` and ``chromium-driver`` (``bash
.ci/install-browser.sh``), driven by Selenium through ``/usr/bin/chromedriver`` (no browser is downloaded).
Every wait is bounded; JupyterLab (its process group: the kernel too) and Chromium are stopped in ``finally``.
The checks of every committed notebook's metadata (kernelspec, language_info) need no browser.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
STEM = "02_memory_wall"
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / f"{STEM}.ipynb"
MAKEFILE = ROOT / "Makefile"
PROFILE_LINE = 'profile: str = "cpu"'
NOISE = "is an Enum subclass and is now natively supported by torch.compile"
RUN_S = 600  # the ci profile's budget for this notebook is 3 minutes on a 2-core CPU; a loaded machine gets slack
START_S = 120
SETTLE_S = 3  # after the kernel is idle: JupyterLab has applied the kernel's metadata by then (dirty at once if any)
WIDGET_BAR = ".jp-OutputArea-output .widget-hprogress"  # ipywidgets' progress bar, as tqdm.notebook draws it
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # requirements.txt pins it; the metadata checks below still run
    webdriver = None


def _makefile_kernel() -> tuple[str, str]:
    """The kernelspec ``make venv`` installs: its ``--name`` and ``--display-name``."""
    found = re.findall(r'ipykernel install .*--name (\S+) --display-name "([^"]+)"', MAKEFILE.read_text())
    assert len(found) == 1, f"{MAKEFILE}: expected one `ipykernel install --name N --display-name D`, found {found}"
    return found[0]


def _notebooks() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_every_notebook_asks_for_the_kernel_the_makefile_installs():
    name, display_name = _makefile_kernel()
    wanted = {"name": name, "display_name": display_name, "language": "python"}
    held = {p.name: json.loads(p.read_text())["metadata"].get("kernelspec") for p in _notebooks()}
    assert held
    assert {k: v for k, v in held.items() if v != wanted} == {}, f"the Makefile installs {wanted}"


def test_every_notebook_holds_the_language_info_its_kernel_reports():
    """What JupyterLab writes into ``metadata.language_info`` when the kernel connects is the kernel's kernel_info
    reply: a notebook holding anything else is marked modified on opening, and saved with it."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")  # ipykernel's own spec: this interpreter
    try:
        reported = client.kernel_info(reply=True, timeout=60)["content"]["language_info"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    held = {p.name: json.loads(p.read_text())["metadata"].get("language_info") for p in _notebooks()}
    differ = sorted(k for k, v in held.items() if v != reported)
    assert held
    assert not differ, (f"metadata.language_info of {', '.join(differ)} is not this kernel's kernel_info reply "
                        f"{reported}: JupyterLab marks them modified on opening (make nbmeta rewrites them)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, predicate, timeout: float, every: float = 0.5):
    """``predicate()``'s first truthy value within ``timeout`` seconds; else a failure naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def _quiet_settings(config_dir: Path) -> None:
    """JupyterLab's user settings: no prompt about fetching Jupyter news (a toast over the notebook)."""
    settings = config_dir / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))


def _install_kernelspec(data_dir: Path) -> str:
    """The kernelspec the Makefile installs for ``.venv`` (its name and display name), running this interpreter;
    returns the display name."""
    name, display_name = _makefile_kernel()
    spec = data_dir / "kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name, "language": "python", "metadata": {"debugger": True}}))
    return display_name


def _strip(path: Path) -> str:
    """``path`` as git would commit it: through the clean filter the Makefile configures (``nbstripout --keep-id``)."""
    assert "filter.nbstripout.clean '$(NBSTRIP) --keep-id'" in MAKEFILE.read_text(), "the Makefile's filter changed"
    with open(path, "rb") as f:
        return subprocess.run([sys.executable, "-m", "nbstripout", "--keep-id"], stdin=f, capture_output=True,
                              check=True, text=True).stdout


def _start_lab(workdir: Path, home: Path, port: int, token: str, log) -> subprocess.Popen:
    """JupyterLab as ``make lab`` starts it: from the repository's root, serving ``notebooks/``."""
    env = {**os.environ,
           "JUPYTER_DATA_DIR": str(home / "data"), "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "IPYTHONDIR": str(home / "ipython"),
           "JUPYTER_PLATFORM_DIRS": "1", "JUPYTER_PREFER_ENV_PATH": "0",  # in a venv, its own python3 spec first
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    env.pop("MACROARCH_COMPILE", None)  # the notebook's kernel as a user's, not the tests' eager setting
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--ServerApp.port={port}",
               "--ServerApp.ip=127.0.0.1", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={workdir / 'notebooks'}", "--LabApp.news_url=None",
               "--LabApp.extension_manager=readonly"]
    if os.geteuid() == 0:  # CI runs as root
        command.append("--allow-root")
    return subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _lab_ready(port: int, token: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _chromium(profile_dir: Path):
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000", f"--user-data-dir={profile_dir}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))


def _texts(driver, css: str) -> list[str]:
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


def _palette(driver, command: str) -> None:
    """Run a JupyterLab command by its label from the command palette (Ctrl+Shift+C)."""
    driver.find_element(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Notebook").click()
    webdriver.ActionChains(driver).key_down(Keys.CONTROL).key_down(Keys.SHIFT).send_keys("c") \
        .key_up(Keys.SHIFT).key_up(Keys.CONTROL).perform()
    field = _wait("the command palette", lambda: next(iter(driver.find_elements(
        By.CSS_SELECTOR, ".lm-CommandPalette-input")), None), 20)
    _wait("the command palette to be shown", field.is_displayed, 20)
    field.clear()
    field.send_keys(command)
    _wait(f"{command!r} in the palette", lambda: command in _texts(driver, ".lm-CommandPalette-itemLabel"), 20)
    field.send_keys(Keys.ENTER)


def _show(driver, css: str, text: str | None = None) -> None:
    """Scroll the first element matching ``css`` (and whose text is ``text``, if given) to the middle of the view."""
    for element in driver.find_elements(By.CSS_SELECTOR, css):
        if text is None or element.text.strip() == text:
            driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
            time.sleep(0.5)  # the notebook renders the cells scrolled into view
            return


def _prompts(driver) -> list[str]:
    return _texts(driver, ".jp-CodeCell .jp-InputArea-prompt")


def _bar_text(bar) -> str:
    """The text of the tqdm widget around ``bar`` (ipywidgets' HBox: description, bar, counts), its white space (tqdm
    pads with figure spaces) as single spaces."""
    text = bar.find_element(By.XPATH, "./ancestor::div[contains(@class, 'widget-hbox')][1]").text
    return re.sub(r"\s+", " ", text).strip()


def _dirty(driver) -> bool:
    """Whether the notebook's tab shows JupyterLab's modified mark."""
    tabs = driver.find_elements(By.CSS_SELECTOR, ".lm-DockPanel-tabBar .lm-TabBar-tab")
    return any("jp-mod-dirty" in (t.get_attribute("class") or "") for t in tabs if NOTEBOOK.name in t.text)


def _set_profile(driver, profile: str) -> None:
    """Type ``profile`` over the word ``cpu`` of the parameters cell's first line, as a user edits it."""
    (editor,) = [e for e in driver.find_elements(By.CSS_SELECTOR, ".jp-CodeCell .cm-content")
                 if PROFILE_LINE in e.text]
    (word,) = [s for s in editor.find_elements(By.CSS_SELECTOR, ".cm-line span") if s.text == '"cpu"']
    webdriver.ActionChains(driver).double_click(word).perform()
    _wait("the word cpu to be selected", lambda: driver.execute_script("return window.getSelection().toString()")
          == "cpu", 20, every=0.2)
    webdriver.ActionChains(driver).send_keys(profile).perform()
    _wait(f"the parameters cell to read profile {profile!r}",
          lambda: PROFILE_LINE.replace("cpu", profile) in editor.text, 20)
    webdriver.ActionChains(driver).send_keys(Keys.ESCAPE).perform()  # out of the editor: command mode


@pytest.mark.slow
@pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                    reason=f"no browser: {CHROMIUM} and {CHROMEDRIVER} are not installed "
                           "(bash .ci/install-browser.sh installs Debian's chromium and chromium-driver)")
@pytest.mark.skipif(webdriver is None, reason="selenium is not installed (requirements.txt pins it)")
def test_jupyterlab_runs_the_notebook_at_the_ci_profile_in_chromium(isolated, tmp_path):
    from macroarch.repro.paper import record_from_result
    from macroarch.repro.tracking import notebook_problem, read_result, result_path
    from macroarch.repro.wandb_offline import find_offline_runs

    committed = NOTEBOOK.read_text()
    kernelspec = json.loads(committed)["metadata"]["kernelspec"]
    home, workdir, shots = tmp_path / "jupyter", tmp_path / "work", tmp_path / "screenshots"
    for d in (home, workdir / "notebooks", shots):
        d.mkdir(parents=True)
    display_name = _install_kernelspec(home / "data")
    _quiet_settings(home / "config")
    copy = workdir / "notebooks" / NOTEBOOK.name
    shutil.copyfile(NOTEBOOK, copy)  # the committed bytes, opened where `make lab` serves them
    as_json = json.dumps(PROFILE_LINE)[1:-1]  # the line as the .ipynb file spells it
    assert committed.count(as_json) == 1, f"{NOTEBOOK}: the parameters cell no longer starts from {PROFILE_LINE!r}"
    port, token = _free_port(), hashlib.sha256(os.urandom(16)).hexdigest()[:32]

    lab = driver = None
    with open(tmp_path / "jupyterlab.log", "w") as log:
        try:
            lab = _start_lab(workdir, home, port, token, log)
            _wait("JupyterLab to answer on 127.0.0.1", lambda: lab.poll() is not None or _lab_ready(port, token),
                  START_S)
            assert lab.poll() is None, (tmp_path / "jupyterlab.log").read_text()[-3000:]
            driver = _chromium(tmp_path / "chromium-profile")
            driver.set_page_load_timeout(START_S)
            driver.get(f"http://127.0.0.1:{port}/lab/tree/{copy.name}?token={token}")

            # Opened with the kernel the notebook asks for: no kernel-selection dialog, its display name shown.
            _wait("the notebook's kernel to be idle", lambda: driver.find_elements(
                By.CSS_SELECTOR, ".jp-NotebookPanel") and "Idle" in " ".join(_texts(driver, ".jp-StatusBar-Widget"))
                or driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog"), START_S)
            assert not driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog"), \
                f"a dialog instead of the kernel: {_texts(driver, '.jp-Dialog')}"
            # Not modified by opening it: JupyterLab has written the kernel's language_info and kernelspec into
            # the notebook's metadata by now, which changes nothing when the committed notebook holds them.
            settle = time.monotonic() + SETTLE_S
            while time.monotonic() < settle and not _dirty(driver):
                time.sleep(0.2)
            driver.save_screenshot(str(shots / "1_opened.png"))
            assert not _dirty(driver), (f"JupyterLab marks {NOTEBOOK.name} modified right after opening it: its "
                                        "metadata (kernelspec, language_info) differs from what the kernel reports")
            shown = " ".join(_texts(driver, ".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName"))
            assert display_name in shown, f"kernel shown: {shown!r}"

            _set_profile(driver, "ci")

            _palette(driver, "Run All Cells")
            _wait("the run to start", lambda: "[*]:" in _prompts(driver), 60, every=0.2)
            _wait("a cell to finish", lambda: any(p.strip() not in ("[*]:", "[ ]:", "") for p in _prompts(driver)),
                  RUN_S, every=0.5)
            _show(driver, ".jp-CodeCell .jp-InputArea-prompt", "[*]:")  # the cell that runs now, and its output
            driver.save_screenshot(str(shots / "2_running.png"))
            progress = []

            def finished():
                if not progress:  # the running cell in view (JupyterLab renders only what is near the view)
                    _show(driver, ".jp-CodeCell .jp-InputArea-prompt", "[*]:")
                if not progress and (bars := driver.find_elements(By.CSS_SELECTOR, WIDGET_BAR)):  # while it runs
                    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", bars[0])
                    driver.save_screenshot(str(shots / "3_progress.png"))
                    progress.append(_bar_text(bars[0]))
                prompts = _prompts(driver)
                done = prompts and "[*]:" not in prompts and all(p.strip() not in ("[ ]:", "") for p in prompts)
                return prompts if done else None

            prompts = _wait("every cell to run", finished, RUN_S, every=1)
            driver.save_screenshot(str(shots / "5_done.png"))

            outputs = driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")
            errors = [e.text for e in outputs if e.get_attribute("data-mime-type") == "application/vnd.jupyter.error"
                      or "Traceback" in e.text]
            assert not errors, errors[0][:2000]
            stderr = " ".join(_texts(driver, '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
            assert NOISE not in stderr  # torchao's deprecation records are filtered at import (macroarch._warnings)
            (tmp_path / "stderr.txt").write_text(stderr)
            assert driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output img"), "no figure rendered"
            _show(driver, ".jp-OutputArea-output img")
            driver.save_screenshot(str(shots / "4_figure.png"))
            if not progress:  # the bar outlived its cell: find it, cell by cell (only cells near the view render)
                for cell in driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"):
                    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", cell)
                    time.sleep(0.2)
                    if bars := driver.find_elements(By.CSS_SELECTOR, WIDGET_BAR):
                        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", bars[0])
                        driver.save_screenshot(str(shots / "3_progress.png"))
                        progress.append(_bar_text(bars[0]))
                        break
            (tmp_path / "progress.txt").write_text(repr(progress))
            assert progress, "no progress widget rendered"
            # tqdm's widget: its description, the bar, then "n/total [elapsed<remaining, rate]"
            assert re.fullmatch(r"\S.*: \d+% \d+/\d+ \[.*\]", progress[0]), f"progress widget text: {progress[0]!r}"
            assert len(prompts) == sum(1 for c in json.loads(copy.read_text())["cells"] if c["cell_type"] == "code")

            before = copy.stat().st_mtime_ns
            _palette(driver, "Save Notebook")
            _wait("the copy to be saved", lambda: copy.stat().st_mtime_ns != before, 30)
        finally:
            if driver is not None:
                driver.quit()
            if lab is not None:
                if lab.poll() is None:
                    os.killpg(lab.pid, signal.SIGTERM)
                try:
                    lab.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(lab.pid, signal.SIGKILL)
                    lab.wait(timeout=30)

    saved = json.loads(copy.read_text())
    code = [c for c in saved["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code)
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"])
    # progress is a widget (ipywidgets is installed), not tqdm's text in a red stderr box
    outputs = [o for c in code for o in c["outputs"]]
    assert any(WIDGET_MIME in o.get("data", {}) for o in outputs), "no progress widget among the outputs"
    assert not [o for o in outputs if o.get("name") == "stderr" and "%|" in "".join(o.get("text", ""))]

    result = read_result(result_path("C4", "ci"))
    assert result["status"] == "complete" and result["config"]["profile"] == "ci"
    assert result["verdict"]["grade"]
    runs = [r for r in find_offline_runs(isolated) if r.run_id == result["wandb"]["id"]]
    assert runs and runs[0].group == "ci" and runs[0].config["profile"] == "ci"

    # the kernel recorded its executed notebook as the run's evidence, where a batch run's goes, as papermill's is
    evidence = isolated / "out" / "ci" / f"{STEM}.ipynb"
    assert notebook_problem(evidence) is None, notebook_problem(evidence)
    recorded = json.loads(evidence.read_text())
    assert recorded["metadata"]["macroarch"]["interactive"] and recorded["metadata"]["kernelspec"] == kernelspec
    assert [c["cell_type"] for c in recorded["cells"]] == [c["cell_type"] for c in saved["cells"]]
    run_code = [c for c in recorded["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in run_code] == [c["execution_count"] for c in code]
    assert any("image/png" in o.get("data", {}) for c in run_code for o in c["outputs"]), "no figure recorded"
    assert any(WIDGET_MIME in o.get("data", {}) for c in run_code for o in c["outputs"]), "no progress recorded"
    assert record_from_result(result, result_path("C4", "ci")).evidence == evidence  # the paper's evidence

    # what git would commit after this session is the committed notebook with the one edit typed in the browser:
    # outputs stripped by the Makefile's filter, and no metadata or cell that JupyterLab added or changed
    assert _strip(copy) == committed.replace(as_json, as_json.replace("cpu", "ci"))
    assert NOTEBOOK.read_text() == committed, f"{NOTEBOOK} was changed"
    shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)  # the screenshots and the log stay
