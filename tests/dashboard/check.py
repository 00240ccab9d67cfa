"""Drives the dashboard in headless Chromium (Selenium, Debian's chromium
and chromium-driver) against a daemon under load; exits non-zero with a
message when something is wrong.

Usage: check.py BASE_URL TOKEN SCREENSHOT.png
Checks: the page signs in with the token from the URL fragment; the latency
heat map canvas gets non-empty pixels; clicking an entry of the breakdown
changes the heat map (it filters it); clicking a column shows that second's
percentiles; the browser logged no errors. Writes a screenshot.
"""
import hashlib
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from waiting import wait_for

base, token, shot = sys.argv[1], sys.argv[2], sys.argv[3]

options = Options()
for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1100",
            "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions"):
    options.add_argument(arg)
options.binary_location = "/usr/bin/chromium"
options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
failures = []


def heat_pixels():
    """Non-background pixels in the heat map's plot area, and a digest of them."""
    data = driver.execute_script("""
        const c = document.getElementById('heat');
        const ctx = c.getContext('2d');
        const r = window.devicePixelRatio || 1;
        const x0 = Math.ceil(64 * r), w = c.width - x0 - Math.ceil(12 * r), h = c.height - Math.ceil(40 * r);
        const d = ctx.getImageData(x0, Math.ceil(10 * r), w, h).data;
        let coloured = 0;
        for (let i = 0; i < d.length; i += 4) {
          // The plot's background is #fbfcfd; grid lines are #eef0f3.
          if (d[i + 3] && !(d[i] >= 0xee && d[i + 1] >= 0xf0 && d[i + 2] >= 0xf3)) coloured++;
        }
        return [coloured, Array.from(d.filter((_, i) => i % 64 === 0)).join(',')];
    """)
    return data[0], hashlib.sha256(data[1].encode()).hexdigest()


try:
    driver.get(f"{base}/ui#token={token}")
    wait_for("the status line to say live", lambda: "live" in driver.find_element(By.ID, "status").text)
    wait_for("the pool panel's scrub line", lambda: "next scrub" in driver.find_element(By.ID, "pools").text)
    coloured, before = wait_for("requests in the heat map", lambda: (lambda p: p if p[0] > 50 else None)(heat_pixels()))
    print(f"heat map: {coloured} coloured pixels")
    # Break down by operation, then click the first entry: the map now shows
    # only that operation's requests.
    driver.execute_script("const s = document.getElementById('by'); s.value = 'op'; s.dispatchEvent(new Event('change'));")
    label = lambda: driver.find_element(By.ID, "heat").get_attribute("aria-label")
    if "where" in label():
        failures.append(f"the map says it is filtered before any click: {label()}")

    def click_an_entry():
        # Found and clicked in one step: the table is redrawn every second.
        for row in driver.find_elements(By.CSS_SELECTOR, "#breakdown tbody tr.pick"):
            name = row.get_attribute("data-name")
            if name in ("read", "write"):
                row.click()
                return name
        return None

    chosen = wait_for("a breakdown entry to click", click_an_entry)
    wait_for("a filter chip", lambda: "op = " + chosen in driver.find_element(By.ID, "filters").text)
    wait_for("the heat map filtered to " + chosen, lambda: f"where op = {chosen}" in label())
    print("filtered:", label())
    coloured_after, after = heat_pixels()
    print(f"after filtering to op={chosen}: {coloured_after} coloured pixels (was {coloured})")
    if after == before:
        failures.append("the heat map did not change when a breakdown entry was clicked")
    # Click a column near the right edge: that second's details appear.
    canvas = driver.find_element(By.ID, "heat")
    width = canvas.size["width"]
    webdriver.ActionChains(driver).move_to_element_with_offset(canvas, width // 2 - 40, 0).click().perform()
    wait_for("a column's percentiles", lambda: "p99" in driver.find_element(By.ID, "selection").text)
    # Drag across a latency band: its requests' volumes and clients appear.
    height = canvas.size["height"]
    (webdriver.ActionChains(driver)
        .move_to_element_with_offset(canvas, 0, height // 2 - 40).click_and_hold()
        .move_by_offset(0, -120).release().perform())
    wait_for("a latency band's breakdown",
             lambda: driver.find_element(By.ID, "seltitle").text.startswith("Latency")
             and "came from" in driver.find_element(By.ID, "selection").text)
    print("band:", driver.find_element(By.ID, "seltitle").text)
    wait_for("the offset map", lambda: driver.execute_script(
        "return document.getElementById('offvol').value !== ''"))
    # The pointer off the map (no tooltip in the screenshot).
    webdriver.ActionChains(driver).move_to_element(driver.find_element(By.TAG_NAME, "h1")).perform()
    time.sleep(1.5)
    driver.save_screenshot(shot)
    for entry in driver.get_log("browser"):
        if entry["level"] in ("SEVERE", "ERROR"):
            failures.append(f"console: {entry['message']}")
finally:
    driver.quit()

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("dashboard ok")
