"""The dashboard in a real browser: Debian's headless Chromium driven by Selenium through Debian's chromedriver.

Needs ``apt-get install chromium chromium-driver`` and the ``selenium`` package. Where either is missing the
tests are skipped on a developer's machine, but FAIL in CI (``CI`` set) or with ``RLTK_BROWSER_TESTS=1``:
browser tests that silently skip would pass CI while testing nothing. Screenshots of each page go to the
test's tmp folder, or to ``$RLTK_SCREENSHOTS`` when set (for the docs).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from rltk.commands.cli import main
from tests.waits import scaled

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = os.environ.get("RLTK_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("RLTK_CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium==4.51.0"


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            return f"{path} is missing"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _missing()
    if missing:
        message = f"browser tests need Chromium, chromedriver and selenium: {missing} (install: {INSTALL})"
        if os.environ.get("CI") or os.environ.get("RLTK_BROWSER_TESTS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors, read by console_errors()
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(scaled(60))
    yield driver
    driver.quit()


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    target = os.environ.get("RLTK_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)
    return path


def wait_for(driver, condition, what: str, timeout: float = 60):
    """Wait until ``condition(driver)`` is truthy, up to :func:`tests.waits.scaled` ``(timeout)``; the error says
    what was awaited."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # the form is drawn anew after each validation: an element read mid-redraw is read again
        return WebDriverWait(driver, scaled(timeout), poll_frequency=0.1,
                             ignored_exceptions=(StaleElementReferenceException,)).until(condition)
    except TimeoutException:
        raise AssertionError(f"waited {scaled(timeout):.0f}s for {what}; status line: "
                             f"{driver.find_element('id', 'status').text!r}") from None


def console_errors(driver) -> list[str]:
    """The console's errors since the last call (uncaught exceptions, failed loads such as a favicon's 404)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def status_ok(driver) -> bool:
    return driver.find_element("id", "status").get_attribute("data-ok") == "true" and not \
        driver.find_element("id", "busy").text


def choose(driver, key: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("css selector", f'select[data-key="{key}"]')).select_by_value(value)


def test_build_a_config_in_the_browser_and_run_validate_on_it(browser, dashboard, tmp_path):
    from selenium.webdriver.common.by import By

    client, _, save_dir = dashboard
    driver = browser
    driver.get(f"http://127.0.0.1:{client.port}/")
    wait_for(driver, status_ok, "the recipe's own config to validate")
    # the beginner view: the few keys a new run needs
    shown = [e.get_attribute("data-field") for e in driver.find_elements(By.CSS_SELECTOR, "#form .field")]
    assert {"model.path", "algorithm.name", "trainer.total_steps", "rollout.engine"} <= set(shown) and len(shown) < 12
    screenshot(driver, tmp_path, "dashboard-beginner")

    # choose a preset: the form shows what it sets
    choose(driver, "algorithm.name", "dapo")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'table[data-preset="dapo"]') and status_ok(d),
             "the dapo preset's table")
    sets = driver.find_element(By.CSS_SELECTOR, 'table[data-preset="dapo"]').text
    assert "algorithm.dynamic_sampling true" in sets and "clip_eps_high" in sets

    # the expert view: every key; swap the advantage function and see its own arguments
    driver.find_element(By.ID, "view-expert").click()
    choose(driver, "algorithm.advantage_fn", "reinforce_plus_plus")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '[data-args-for="algorithm.advantage_fn_args"]')
             and "arguments of reinforce_plus_plus" in d.find_element(
                 By.CSS_SELECTOR, '[data-args-for="algorithm.advantage_fn_args"]').text
             and status_ok(d), "reinforce_plus_plus's arguments")
    assert "algorithm.advantage_fn=reinforce_plus_plus" in driver.find_element(By.ID, "command").text
    gamma = driver.find_element(By.CSS_SELECTOR, 'input[data-key="algorithm.advantage_fn_args.gamma"]')
    assert gamma.get_attribute("placeholder") == "default 1"  # from the function's signature
    gamma.send_keys("0.99")
    wait_for(driver, lambda d: "algorithm.advantage_fn_args.gamma=0.99" in d.find_element(By.ID, "command").text
             and status_ok(d), "the argument in the command line")

    # a bad value: the error appears beside its field, with the validator's text; fixed, it disappears
    driver.find_element(By.CSS_SELECTOR, 'details[data-section="trainer"] > summary').click()
    lr = driver.find_element(By.CSS_SELECTOR, 'input[data-key="trainer.lr"]')
    lr.clear()
    lr.send_keys("-1")
    error = wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '[data-error-for="trainer.lr"]'),
                     "the error beside trainer.lr")[0]
    assert error.text == "bad value -1.0 for 'trainer.lr': must be > 0"
    screenshot(driver, tmp_path, "dashboard-error")
    lr = driver.find_element(By.CSS_SELECTOR, 'input[data-key="trainer.lr"]')
    lr.clear()
    lr.send_keys("0.0001")
    wait_for(driver, lambda d: status_ok(d) and not d.find_elements(By.CSS_SELECTOR, "[data-error-for]"),
             "the error to go")

    # save it, and `rltk validate` takes the file
    name = driver.find_element(By.ID, "save-name")
    name.clear()
    name.send_keys("from_browser.yaml")
    driver.find_element(By.ID, "save").click()
    wait_for(driver, lambda d: d.find_element(By.ID, "save-result").get_attribute("data-path"), "the save")
    saved = save_dir / "from_browser.yaml"
    assert driver.find_element(By.ID, "save-result").get_attribute("data-path") == str(saved)
    config = yaml.safe_load(saved.read_text())
    assert config["algorithm"]["name"] == "dapo" and config["algorithm"]["advantage_fn"] == "reinforce_plus_plus"
    assert config["algorithm"]["advantage_fn_args"] == {"gamma": 0.99}
    assert config["trainer"]["lr"] == 0.0001
    assert main(["validate", "--config", str(saved), "grpo"]) == 0
    screenshot(driver, tmp_path, "dashboard-expert")


def test_read_a_real_runs_trajectories_in_the_browser(browser, dashboard, tmp_path, real_run):
    from selenium.webdriver.common.by import By

    client, runs_root, _ = dashboard
    shutil.copytree(real_run, runs_root / "tiny")
    traced = sorted({int(line.split(",")[0].split(":")[1]) for line in
                     (real_run / "traces.jsonl").read_text().splitlines()})
    driver = browser
    driver.get(f"http://127.0.0.1:{client.port}/#runs")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#runs-list button[data-run="tiny"]'), "the run list")
    driver.find_element(By.CSS_SELECTOR, '#runs-list button[data-run="tiny"]').click()
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#curves [data-panel="train reward"] svg'),
             "the curves")
    panels = [p.get_attribute("data-panel") for p in driver.find_elements(By.CSS_SELECTOR, "#curves .panel")]
    assert panels == ["warm-up (SFT) loss", "train reward", "held-out accuracy"]  # the panels of curves.png
    step = traced[-1]
    row = driver.find_element(By.CSS_SELECTOR, f'#steps tr.has-traces[data-step="{step}"]')
    row.click()
    groups = wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#traces .group"), "the step's groups")
    from rltk.training.scaffold.traces import read_traces

    expected = read_traces(real_run / "traces.jsonl", step=step)
    by_group: dict = {}
    for record in expected:
        by_group.setdefault(record["group_id"], []).append(record)
    assert len(groups) == len(by_group) and len(by_group) < len(expected)  # rollout.n samples a prompt
    for group, records in zip(groups, by_group.values()):
        # the prompt once, then the group's samples, best advantage first
        assert [p.text for p in group.find_elements(By.CSS_SELECTOR, "pre.prompt")] == [records[0]["prompt"].strip()]
        rows = group.find_elements(By.CSS_SELECTOR, ".sample")
        ranked = sorted(records, key=lambda r: -r["advantage"])
        assert [float(r.get_attribute("data-advantage")) for r in rows] == [r["advantage"] for r in ranked]
        best, record = rows[0], ranked[0]
        assert f"score {record['score']:.4g}" in best.find_element(By.CSS_SELECTOR, ".sample-meta").text
        tokens = best.find_elements(By.CSS_SELECTOR, ".tokens .tok")
        assert "".join(t.get_attribute("textContent") for t in tokens) == "".join(record["tokens"])
        assert [t.get_attribute("data-mask") for t in tokens] == [str(m) for m in record["response_mask"]]
        assert "advantage" in tokens[0].get_attribute("title")
    # a group of 4 short answers stays compact: well under 300 px a sample
    height = driver.execute_script("return arguments[0].getBoundingClientRect().height", groups[0])
    assert height < 100 + 60 * len(by_group[expected[0]["group_id"]]), height
    # every traced step of a real run, and its curves and table, draw without a console error
    for other in [s for s in traced if s != step]:
        driver.find_element(By.CSS_SELECTOR, f'#steps tr.has-traces[data-step="{other}"]').click()
        wait_for(driver, lambda d: d.find_element(By.ID, "traces-title").text.startswith(f"step {other}:"),
                 f"step {other}'s trajectories")
    assert console_errors(driver) == []
    driver.find_element(By.CSS_SELECTOR, f'#steps tr.has-traces[data-step="{step}"]').click()
    rows = wait_for(driver, lambda d: d.find_element(By.ID, "traces-title").text.startswith(f"step {step}:")
                    and d.find_elements(By.CSS_SELECTOR, "#traces .sample"), "the samples again")
    first = rows[0]
    first.find_element(By.CSS_SELECTOR, ".sample-details > summary").click()  # the rest of a sample, on demand
    assert "exact_match" in first.find_element(By.CSS_SELECTOR, "table.rewards").text
    driver.execute_script("arguments[0].scrollIntoView()", first)
    screenshot(driver, tmp_path, "dashboard-run")

    # live: a step the run logs now shows up in the table without a reload (the page polls every 3 s)
    with open(runs_root / "tiny" / "metrics.jsonl", "a") as f:
        f.write('{"step": 999, "reward": 0.5}\n')
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#steps tr[data-step="999"]'), "the new step", 20)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A real `rltk run grpo` on the embedded tiny default, cut short: warm-up, 3 GRPO steps, traces on."""
    run_dir = tmp_path_factory.mktemp("real") / "tiny"
    assert main(["run", "grpo", f"output_dir={run_dir}", "logging.logger=[jsonl]", "data.train_size=40",
                 "data.eval_size=8", "sft.steps=4", "sft.stop_at_accuracy=null", "sft.warmup_steps=1",
                 "trainer.total_steps=3", "trainer.warmup_steps=0", "trainer.prompts_per_step=4", "rollout.n=4",
                 "trainer.eval_every=3", "logging.traces_per_step=8", "checkpoint.every=0"]) == 0
    return run_dir


def _box(driver, css):
    return driver.find_element("css selector", css)


def _selected(driver, key):
    from selenium.webdriver.support.ui import Select

    option = Select(_box(driver, f'select[data-key="{key}"]')).first_selected_option
    return option.get_attribute("value"), option.get_attribute("textContent")


def test_fields_show_the_real_default_and_the_value_that_wins(browser, dashboard, tmp_path):
    from selenium.webdriver.common.by import By

    client, _, _ = dashboard
    driver = browser
    driver.set_window_size(1400, 1000)
    driver.get(f"http://127.0.0.1:{client.port}/#build")
    wait_for(driver, status_ok, "the recipe's own config to validate")
    driver.find_element(By.ID, "view-expert").click()
    command = lambda d: d.find_element(By.ID, "command").text  # noqa: E731

    # a yes/no argument left unset shows its default (None: unset), not the first choice
    assert _selected(driver, "strategy_args.cpu") == ("", "default null")
    assert _selected(driver, "strategy_args.fsdp") == ("", "default false")
    assert _selected(driver, "algorithm.advantage_fn_args.norm_by_std") == ("true", "true")  # the grpo preset's
    choose(driver, "strategy_args.cpu", "true")
    wait_for(driver, lambda d: "strategy_args.cpu=true" in command(d) and status_ok(d), "the override")
    choose(driver, "strategy_args.cpu", "")  # back to "default null": the override goes
    wait_for(driver, lambda d: "strategy_args.cpu" not in command(d) and status_ok(d), "the override to go")
    choose(driver, "strategy_args.fsdp", "true")
    wait_for(driver, lambda d: "strategy_args.fsdp=true" in command(d) and status_ok(d), "the fsdp override")
    choose(driver, "strategy_args.fsdp", "false")  # the default itself: nothing left to override
    wait_for(driver, lambda d: command(d) == "rltk run grpo" and status_ok(d), "the fsdp override to go")

    # typing a field back to the value it has without an override removes the override (grpo.yaml: lr 1.0e-4)
    driver.find_element(By.CSS_SELECTOR, 'details[data-section="trainer"] > summary').click()
    lr = _box(driver, 'input[data-key="trainer.lr"]')
    lr.clear()
    lr.send_keys("0.0003")
    wait_for(driver, lambda d: "trainer.lr=0.0003" in command(d) and status_ok(d), "the lr override")
    lr = _box(driver, 'input[data-key="trainer.lr"]')
    lr.clear()
    lr.send_keys("1e-4")
    wait_for(driver, lambda d: command(d) == "rltk run grpo" and status_ok(d), "the lr override to go")
    assert driver.find_element(By.ID, "overrides").text == ""

    # a preset's rows say what wins: grpo.yaml's kl_coef 0.05 over dapo's 0.0; an override over the preset
    driver.find_element(By.CSS_SELECTOR, 'details[data-section="algorithm"] > summary').click()
    choose(driver, "algorithm.name", "dapo")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'table[data-preset="dapo"]') and status_ok(d),
             "the dapo preset's table")
    wins = lambda d, key: _box(d, f'table[data-preset="dapo"] tr[data-key="{key}"]')  # noqa: E731
    assert wins(driver, "algorithm.kl_coef").get_attribute("data-wins") == "file"
    assert "overridden by the recipe's config file: 0.05" in wins(driver, "algorithm.kl_coef").text
    assert wins(driver, "algorithm.dynamic_sampling").get_attribute("data-wins") == "preset"
    eps_high = _box(driver, 'input[data-key="algorithm.policy_loss_args.clip_eps_high"]')
    assert eps_high.get_attribute("value") == "0.28"  # the preset's argument, shown as the value it is
    eps_high.clear()
    eps_high.send_keys("0.3")
    wait_for(driver, lambda d: wins(d, "algorithm.policy_loss_args.clip_eps_high").get_attribute("data-wins")
             == "override" and status_ok(d), "the override to win over the preset")
    assert "overridden by your override: 0.3" in wins(driver, "algorithm.policy_loss_args.clip_eps_high").text

    # a value of the wrong type is an error beside its argument, in the validator's words
    eps = _box(driver, 'input[data-key="algorithm.advantage_fn_args.eps"]')
    eps.send_keys("abc")
    error = wait_for(driver, lambda d: d.find_elements(
        By.CSS_SELECTOR, '[data-error-for="algorithm.advantage_fn_args.eps"]'), "the error beside eps")[0]
    assert error.text == ("'algorithm.advantage_fn_args.eps': bad value 'abc' for argument 'eps' of advantage_fn "
                          "'grpo': must be a number; default 1e-06")
    assert len(driver.find_elements(By.CSS_SELECTOR, "[data-error-for]")) == 1  # once, not also on the field
    screenshot(driver, tmp_path, "dashboard-what-wins")
    assert console_errors(driver) == []


def test_the_form_reads_as_prose_and_offers_choices(browser, dashboard):
    from selenium.webdriver.common.by import By

    client, _, _ = dashboard
    driver = browser
    driver.get(f"http://127.0.0.1:{client.port}/#build")
    wait_for(driver, status_ok, "the recipe's own config to validate")
    # data.task is a choice of the registered tasks
    assert "countdown" in [o.get_attribute("value") for o in driver.find_elements(
        By.CSS_SELECTOR, 'select[data-key="data.task"] option')]
    driver.find_element(By.ID, "view-expert").click()
    text = driver.find_element(By.ID, "form").text
    assert "Config(" not in text and "``" not in text
    algorithm = _box(driver, 'details[data-section="algorithm"] > .section-doc').get_attribute("textContent")
    assert algorithm.startswith("The RL algorithm: a preset (name)")
    stages = _box(driver, 'input[data-key="stages"]').get_attribute("value")
    assert stages == "[{name: warmup, type: sft, overrides: {}}, {name: grpo, type: rl, overrides: {}}]" or \
        stages.startswith("[{name: ")
    # a component's arguments are its form; no free-text box for the mapping the form fills
    assert driver.find_elements(By.CSS_SELECTOR, '[data-args-for="algorithm.advantage_fn_args"]')
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-field="algorithm.advantage_fn_args"]')
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-field="strategy_args"]')
    assert driver.find_elements(By.CSS_SELECTOR, '[data-field="data.task_args"]')  # a task has no argument form


def test_the_builder_holds_at_1024_px(browser, dashboard, tmp_path):
    from selenium.webdriver.common.by import By

    client, _, _ = dashboard
    driver = browser
    driver.set_window_size(1024, 900)
    try:
        driver.get(f"http://127.0.0.1:{client.port}/#build")
        wait_for(driver, status_ok, "the recipe's own config to validate")
        choose(driver, "algorithm.name", "dapo")
        wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'table[data-preset="dapo"]') and status_ok(d),
                 "the dapo preset's table")
        driver.find_element(By.ID, "view-expert").click()
        panel_left = driver.execute_script("return document.getElementById('result').getBoundingClientRect().left")
        overflow = driver.execute_script("""
            const limit = arguments[0];
            return [...document.querySelectorAll('#form *')].filter((n) => n.getClientRects().length
              && n.getBoundingClientRect().right > limit + 1).map((n) => n.outerHTML.slice(0, 80));""", panel_left)
        assert overflow == []  # nothing of the form runs under the right panel
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        screenshot(driver, tmp_path, "dashboard-1024")
    finally:
        driver.set_window_size(1400, 1000)


def test_the_run_viewer_lists_live_says_when_a_run_is_missing_and_follows_links(browser, dashboard, tmp_path):
    from selenium.webdriver.common.by import By

    from tests.dashboard.conftest import write_run

    client, runs_root, _ = dashboard
    driver = browser
    console_errors(driver)  # start from a clean console
    driver.get(f"http://127.0.0.1:{client.port}/#runs/no-such-run")
    wait_for(driver, lambda d: d.find_element(By.ID, "run-title").text == "no run named 'no-such-run'",
             "the missing run to be named")
    assert "Choose a run from the list" in driver.find_element(By.ID, "run-summary").text
    # a run started after the page opened appears without a click
    write_run(runs_root / "demo")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#runs-list button[data-run="demo"]'),
             "the new run in the list", 15)
    # the builder, then a link to the run in the same tab
    driver.get(f"http://127.0.0.1:{client.port}/")
    wait_for(driver, status_ok, "the builder")
    driver.execute_script("location.hash = '#runs/demo'")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#steps tr[data-step="4"]'), "the run's table")
    assert not driver.find_element(By.ID, "page-runs").get_attribute("class").count("hidden")

    # the step table: one row per step (step 2's warm-up and evaluation rows merged), one format per column
    steps = [r.get_attribute("data-step") for r in driver.find_elements(By.CSS_SELECTOR, "#steps tbody tr")]
    assert steps == ["1", "2", "3", "4"]
    header = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#steps th")]
    column = lambda key: [td.text for td in driver.find_elements(  # noqa: E731
        By.CSS_SELECTOR, f"#steps tbody td:nth-child({header.index(key) + 1})")]
    assert column("eval/accuracy") == ["", "0.2500", "", "0.5000"]
    assert column("kl") == ["", "", "0.01000", "0.02000"]
    assert column("sft/sft_loss") == ["2.000", "1.500", "", ""]
    wrap = _box(driver, ".table-wrap")
    assert driver.execute_script("return arguments[0].scrollWidth <= arguments[0].clientWidth", wrap)
    assert _box(driver, "#steps th").value_of_css_property("position") == "sticky"
    screenshot(driver, tmp_path, "dashboard-runs")
    assert console_errors(driver) == []  # no uncaught error, no favicon 404


def test_metrics_are_filtered_smoothed_and_drawn_on_a_log_scale(browser, dashboard):
    from selenium.webdriver.common.by import By

    from tests.dashboard.conftest import write_run

    client, runs_root, _ = dashboard
    write_run(runs_root / "demo")
    driver = browser
    driver.get(f"http://127.0.0.1:{client.port}/#runs/demo")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#curves [data-panel="held-out accuracy"] svg'),
             "the curves")
    driver.find_element(By.ID, "metric-filter").send_keys("sampled")  # one match: it is plotted
    line = wait_for(driver, lambda d: d.find_elements(
        By.CSS_SELECTOR, '#extra-curve [data-panel="eval/sampled_accuracy"] polyline'), "the filtered metric")[0]
    assert line.get_attribute("data-values") == "0.125 0.375"
    options = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#extra-metric option")]
    assert options == ["", "eval/sampled_accuracy"]

    def drawn(panel="eval/sampled_accuracy"):
        return driver.find_element(By.CSS_SELECTOR, f'[data-panel="{panel}"] polyline').get_attribute("data-values")

    # smoothing 0.5: a debiased moving average, 0.125 then (0.5 * 0.0625 + 0.5 * 0.375) / (1 - 0.25) = 0.2917
    driver.execute_script("const s = document.getElementById('smoothing'); s.value = '0.5';"
                          "s.dispatchEvent(new Event('input'))")
    wait_for(driver, lambda d: drawn() == "0.125 0.2917", "the smoothed curve")
    driver.execute_script("const s = document.getElementById('smoothing'); s.value = '0';"
                          "s.dispatchEvent(new Event('input'))")
    driver.find_element(By.ID, "log-scale").click()  # log10 of 0.125 and 0.375
    wait_for(driver, lambda d: drawn() == "-0.9031 -0.426", "the log-scale curve")
    assert console_errors(driver) == []


def _step_x(driver, svg, step: int) -> float:
    """The pixel offset of ``step`` from the centre of a chart's SVG (what ActionChains offsets are from)."""
    return driver.execute_script("""
        const [svg, step] = arguments; const [x0, x1] = svg.dataset.steps.split(' ').map(Number);
        const box = svg.getBoundingClientRect(), W = 720, L = 50, R = 10;
        return (L + (step - x0) / (x1 - x0) * (W - L - R)) * box.width / W - box.width / 2;""", svg, step)


def test_runs_overlay_on_one_chart_with_a_legend_a_tooltip_and_zoom(browser, dashboard, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    from tests.dashboard.conftest import write_run

    client, runs_root, _ = dashboard
    write_run(runs_root / "base")
    write_run(runs_root / "better", reward_offset=0.125)  # rewards 0.625, 0.875
    driver = browser
    console_errors(driver)
    driver.get(f"http://127.0.0.1:{client.port}/#runs/base")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#curves [data-panel="train reward"] svg'),
             "the curves")
    _box(driver, '#runs-list input[data-compare="better"]').click()  # overlay the other run
    reward = '#curves [data-panel="train reward"]'
    lines = wait_for(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, f"{reward} polyline")) == 2
                     and d.find_elements(By.CSS_SELECTOR, f"{reward} polyline"), "both runs' reward lines")
    drawn = {line.get_attribute("data-run"): line for line in lines}
    assert drawn["base"].get_attribute("data-values") == "0.5 0.75"
    assert drawn["better"].get_attribute("data-values") == "0.625 0.875"
    assert drawn["base"].get_attribute("stroke") != drawn["better"].get_attribute("stroke")  # a colour each
    legend = driver.find_elements(By.CSS_SELECTOR, "#legend .legend-run")
    assert [e.text for e in legend] == ["base", "better"]
    # a panel of two curves keeps both, per run: 4 lines, the run in the colour, the curve in the dash
    held_out = driver.find_elements(By.CSS_SELECTOR, '#curves [data-panel="held-out accuracy"] polyline')
    assert [(p.get_attribute("data-run"), p.get_attribute("data-label")) for p in held_out] == [
        ("base", "greedy"), ("base", "sampled"), ("better", "greedy"), ("better", "sampled")]
    assert held_out[0].get_attribute("stroke-dasharray") != held_out[1].get_attribute("stroke-dasharray")

    # smoothing applies to every line: 0.5, then (0.5 * 0.25 + 0.5 * 0.75) / 0.75 = 0.6667 (0.7917 for the other)
    driver.execute_script("const s = document.getElementById('smoothing'); s.value = '0.5';"
                          "s.dispatchEvent(new Event('input'))")
    wait_for(driver, lambda d: [p.get_attribute("data-values") for p in d.find_elements(
        By.CSS_SELECTOR, f"{reward} polyline")] == ["0.5 0.6667", "0.625 0.7917"], "both lines smoothed")
    driver.execute_script("const s = document.getElementById('smoothing'); s.value = '0';"
                          "s.dispatchEvent(new Event('input'))")

    # the tooltip names every line at the step under the pointer
    svg = _box(driver, f"{reward} svg")
    ActionChains(driver).move_to_element_with_offset(svg, int(_step_x(driver, svg, 4)), 0).perform()
    tooltip = wait_for(driver, lambda d: "better" in d.find_element(By.ID, "tooltip").text
                       and d.find_element(By.ID, "tooltip").text, "the tooltip")
    assert tooltip.splitlines() == ["step 4", "base · per step: 0.75", "better · per step: 0.875"]

    # the metric filter plots the metric for every run
    driver.find_element(By.ID, "metric-filter").send_keys("reward")
    extra = wait_for(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#extra-curve polyline")) == 2
                     and d.find_elements(By.CSS_SELECTOR, "#extra-curve polyline"), "the filtered metric, twice")
    assert [p.get_attribute("data-run") for p in extra] == ["base", "better"]

    # zoom: drag over steps 3..4 of the held-out chart (steps 2..4); every chart shows 3..4; double-click: all
    svg = _box(driver, '#curves [data-panel="held-out accuracy"] svg')
    assert svg.get_attribute("data-steps") == "2 4"
    start, end = _step_x(driver, svg, 2.6), _step_x(driver, svg, 4)
    ActionChains(driver).move_to_element_with_offset(svg, int(start), 0).click_and_hold() \
        .move_by_offset(int((end - start) / 2), 0).move_by_offset(int((end - start) / 2), 0).release().perform()
    wait_for(driver, lambda d: _box(d, '#curves [data-panel="held-out accuracy"] svg').get_attribute("data-steps")
             == "3 4", "the zoom")
    assert _box(driver, '#curves [data-panel="held-out accuracy"] polyline').get_attribute("data-values") == "0.5"
    assert _box(driver, f"{reward} svg").get_attribute("data-steps") == "3 4"
    assert "steps 3 to 4" in driver.find_element(By.ID, "zoom-note").text
    screenshot(driver, tmp_path, "dashboard-overlay")
    ActionChains(driver).double_click(_box(driver, '#curves [data-panel="held-out accuracy"] svg')).perform()
    wait_for(driver, lambda d: _box(d, '#curves [data-panel="held-out accuracy"] svg').get_attribute("data-steps")
             == "2 4", "all steps again")
    assert driver.find_element(By.ID, "zoom-note").text == "drag across a chart to zoom in"
    # unticked, the other run leaves the charts
    _box(driver, '#runs-list input[data-compare="better"]').click()
    wait_for(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, f"{reward} polyline")) == 1, "one run again")
    assert driver.find_elements(By.CSS_SELECTOR, "#legend .legend-run") == []
    assert driver.execute_script("return location.hash") == "#runs/base"

    # a comparison is a link: the address names the runs overlaid, and opening it draws them (a missing one
    # is left out)
    _box(driver, '#runs-list input[data-compare="better"]').click()
    wait_for(driver, lambda d: d.execute_script("return location.hash") == "#runs/base?compare=better", "the link")
    driver.get(f"http://127.0.0.1:{client.port}/#runs/better?compare=base,gone")
    wait_for(driver, lambda d: [p.get_attribute("data-run") for p in d.find_elements(
        By.CSS_SELECTOR, f"{reward} polyline")] == ["better", "base"], "the linked comparison")
    assert _box(driver, '#runs-list input[data-compare="base"]').is_selected()
    wait_for(driver, lambda d: d.execute_script("return location.hash") == "#runs/better?compare=base",
             "the missing run dropped from the address")
    assert console_errors(driver) == []


def test_a_step_reads_as_groups_with_whole_multi_turn_responses(browser, dashboard, tmp_path):
    import json

    from selenium.webdriver.common.by import By

    from tests.dashboard.conftest import write_run

    client, runs_root, _ = dashboard
    folder = write_run(runs_root / "agent")

    def sample(group, index, prompt, advantage, turns):
        tokens, mask = [], []
        for i, turn in enumerate(turns):  # assistant turns, an observation between each two
            if i:
                tokens += ["<obs>", " 7"]
                mask += [0, 0]
            tokens += list(turn)
            mask += [1] * len(turn)
        return {"step": 3, "stage": "grpo", "stage_step": 1, "row": 3 * group + index, "group_id": group,
                "sample_index": index, "row_id": f"r{group}", "prompt": prompt, "response": turns[-1],
                "ground_truth": "7", "score": max(advantage or 0.0, 0.0), "rewards": {"exact_match": max(advantage or 0.0, 0.0)},
                "advantage": advantage, "finish_reason": "stop", "source": "policy", "staleness": 0,
                "response_tokens": len(tokens), "policy_tokens": sum(mask), "tokens": tokens,
                "token_ids": list(range(len(tokens))), "response_mask": mask, "advantages": [advantage] * len(tokens),
                "logprobs": [-0.5] * len(tokens), "token_rewards": [0.0] * len(tokens), "values": None, "info": {}}

    # traced in batch order: the group's samples are not sorted by advantage in the file
    traces = [sample(0, 0, "3+4=", -0.5, ["calc", "8"]), sample(0, 1, "3+4=", 1.0, ["calc", "7"]),
              sample(0, 2, "3+4=", 0.0, ["calc", "calc", "7?"]), sample(1, 0, "9-2=", 0.0, ["7"])]
    bare = {k: v for k, v in sample(2, 0, "1+1=", None, ["2"]).items()  # a record without token lists
            if k not in ("tokens", "token_ids", "response_mask", "advantages", "logprobs", "token_rewards")}
    traces.append({**bare, "advantage": None, "score": None, "rewards": {}})
    (folder / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    driver = browser
    console_errors(driver)
    driver.get(f"http://127.0.0.1:{client.port}/#runs/agent")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#steps tr.has-traces[data-step="3"]'), "the table")
    # a click on a chart (not a drag) at a traced step opens that step
    from selenium.webdriver.common.action_chains import ActionChains

    svg = _box(driver, '#curves [data-panel="train reward"] svg')
    ActionChains(driver).move_to_element_with_offset(svg, int(_step_x(driver, svg, 3)) + 2, 0).click().perform()
    groups = wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#traces .group"), "the groups")
    assert svg.get_attribute("data-steps") == "3 4"  # a click does not zoom
    assert driver.find_element(By.ID, "traces-title").text.startswith("step 3: 5 sampled trajectories in 3 groups")
    assert [g.find_element(By.CSS_SELECTOR, "pre.prompt").text for g in groups] == ["3+4=", "9-2=", "1+1="]
    assert len(driver.find_elements(By.CSS_SELECTOR, "#traces pre.prompt")) == 3  # each prompt once
    assert groups[2].find_element(By.CSS_SELECTOR, ".sample-body > pre.response").text == "2"  # its text instead
    rows = groups[0].find_elements(By.CSS_SELECTOR, ".sample")
    assert [r.find_element(By.CSS_SELECTOR, ".advantage").text for r in rows] == ["adv +1", "adv 0", "adv -0.5"]
    # the whole episode, every turn: the third sample's three assistant turns and two observations, greyed
    third = rows[1]
    labels = [e.text for e in third.find_elements(By.CSS_SELECTOR, ".turn-label")]
    assert labels == ["[assistant turn 1]", "[observation]", "[assistant turn 2]", "[observation]",
                      "[assistant turn 3]"]
    assert "".join(t.get_attribute("textContent") for t in third.find_elements(By.CSS_SELECTOR, ".tok")) == \
        "calc<obs> 7calc<obs> 77?"
    observed = third.find_elements(By.CSS_SELECTOR, ".tok.obs")
    assert [t.get_attribute("textContent") for t in observed] == ["<obs>", " 7", "<obs>", " 7"]
    assert observed[0].value_of_css_property("color") == "rgba(119, 119, 119, 1)"  # grey: not the policy's
    # a single-turn answer has no turn labels to wade through
    assert groups[1].find_elements(By.CSS_SELECTOR, ".turn-label") == []
    screenshot(driver, tmp_path, "dashboard-groups")
    assert console_errors(driver) == []


def test_a_prompts_images_show_as_thumbnails_beside_it_and_in_the_transcript(browser, dashboard, tmp_path):
    """Records with ``images`` (rltk.data.images.thumbnail of real images) show each thumbnail beside the
    group's prompt, decoded by the browser at its own size; an environment's image in the transcript shows in
    its message; a thumbnail that is not a PNG the trace carries (an address out) is never loaded."""
    import json

    from PIL import Image
    from selenium.webdriver.common.by import By

    from rltk.data.images import thumbnail
    from tests.dashboard.conftest import write_run

    client, runs_root, _ = dashboard
    folder = write_run(runs_root / "eyes")
    records = [json.loads(line) for line in (folder / "traces.jsonl").read_text().splitlines()]
    wide, square = Image.new("RGB", (120, 60), (255, 0, 0)), Image.new("RGB", (56, 56), (0, 0, 255))
    seen = thumbnail(Image.new("RGB", (30, 30), (0, 160, 0)))
    for record in records:
        record["images"] = [thumbnail(wide), thumbnail(square), {"type": "image", "width": 1, "height": 1,
                                                                 "thumbnail": "http://127.0.0.1:9/x.png"}]
        record["info"]["messages"].insert(1, {"role": "user", "content": [seen, {"type": "text", "text": "what now?"}]})
    (folder / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    driver = browser
    console_errors(driver)
    driver.get(f"http://127.0.0.1:{client.port}/#runs/eyes")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#steps tr.has-traces[data-step="4"]'), "the table")
    driver.find_element(By.CSS_SELECTOR, '#steps tr.has-traces[data-step="4"]').click()
    group = wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#traces .group"), "the groups")[0]
    row = group.find_element(By.CSS_SELECTOR, ".prompt-row")
    assert row.find_element(By.CSS_SELECTOR, "pre.prompt").text == "40+2="
    thumbs = row.find_elements(By.CSS_SELECTOR, ".thumbs img.thumb")
    assert len(thumbs) == 2  # the address out is not shown
    loaded = wait_for(driver, lambda d: [d.execute_script("return [arguments[0].complete, arguments[0].naturalWidth, "
                                                          "arguments[0].naturalHeight]", t) for t in thumbs]
                      if all(d.execute_script("return arguments[0].complete", t) for t in thumbs) else None,
                      "the thumbnails to decode")
    assert loaded == [[True, 64, 32], [True, 56, 56]]  # the PNGs the trace holds, aspect kept, never enlarged
    assert thumbs[0].get_attribute("title") == "image, 120 x 60 px (thumbnail)"
    beside = driver.execute_script("const a = arguments[0].getBoundingClientRect(), b = arguments[1]"
                                   ".getBoundingClientRect(); return [a.right <= b.left, a.top < b.bottom]",
                                   thumbs[1], row.find_element(By.CSS_SELECTOR, "pre.prompt"))
    assert beside == [True, True]  # to the left of the prompt, on its line
    sample = group.find_elements(By.CSS_SELECTOR, ".sample")[0]
    sample.find_element(By.CSS_SELECTOR, ".sample-details > summary").click()
    message = sample.find_elements(By.CSS_SELECTOR, ".messages .msg")[1]
    assert message.text.startswith("user:") and "what now?" in message.text
    image = message.find_element(By.CSS_SELECTOR, "img.thumb")
    wait_for(driver, lambda d: d.execute_script("return arguments[0].naturalWidth", image) == 30,
             "the transcript's image")
    assert driver.find_elements(By.CSS_SELECTOR, 'img[src^="http"]') == []
    screenshot(driver, tmp_path, "dashboard-images")
    assert console_errors(driver) == []
