"""The dashboard in headless Firefox (Debian's firefox-esr), driven over
Marionette (Mozilla's own browser protocol, the `marionette_driver`
package) on a port Firefox picks itself; exits non-zero with a message
when something is wrong.

Usage: firefox.py BASE_URL TOKEN SCREENSHOT.png
Checks: the page signs in from the URL fragment and goes live; the heat
map gets non-empty pixels; clicking a breakdown entry filters it (the
map's counts change and a filter chip appears). Writes a screenshot.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

from marionette_driver.marionette import Marionette
from waiting import wait_for

base, token, shot = sys.argv[1:4]
profile = tempfile.mkdtemp(prefix="strata-firefox-")
with open(os.path.join(profile, "user.js"), "w") as f:
    # Port 0: Firefox picks a free port and writes it to MarionetteActivePort.
    f.write('user_pref("marionette.port", 0);\n')
browser = subprocess.Popen(
    ["firefox-esr", "--headless", "--marionette", "--no-remote", "--profile", profile, "--window-size=1400,1100"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


PIXELS = """
  const c = document.getElementById('heat');
  const d = c.getContext('2d').getImageData(70, 10, c.width - 90, c.height - 50).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i + 3] && !(d[i] >= 0xee && d[i + 1] >= 0xf0 && d[i + 2] >= 0xf3)) n++;
  return n;"""

session = None
try:
    port_file = os.path.join(profile, "MarionetteActivePort")
    port = wait_for("Firefox's Marionette port",
                    lambda: os.path.exists(port_file) and open(port_file).read().strip())
    session = Marionette(host="127.0.0.1", port=int(port))
    session.start_session()
    session.navigate(f"{base}/ui#token={token}")
    script = session.execute_script
    wait_for("the status line to say live", lambda: "live" in script("return document.getElementById('status').textContent"))
    coloured = wait_for("requests in the heat map", lambda: (lambda n: n if n > 50 else None)(script(PIXELS)))
    print(f"firefox: heat map {coloured} coloured pixels")
    script("const s = document.getElementById('by'); s.value = 'op'; s.dispatchEvent(new Event('change'));")
    wait_for("breakdown rows by operation", lambda: script(
        "return [...document.querySelectorAll('#breakdown tbody tr.pick')].some(r => r.dataset.name === 'read')"))
    label = lambda: script("return document.getElementById('heat').getAttribute('aria-label')")
    if "where" in label():
        raise SystemExit(f"the map says it is filtered before any click: {label()}")
    script("[...document.querySelectorAll('#breakdown tbody tr.pick')].find(r => r.dataset.name === 'read').click()")
    wait_for("a filter chip", lambda: "op = read" in script("return document.getElementById('filters').textContent"))
    wait_for("the heat map filtered to reads", lambda: "where op = read" in label())
    print("firefox: filtered:", label())
    time.sleep(1)
    with open(shot, "wb") as f:
        f.write(session.screenshot(format="binary"))
    print("dashboard ok in firefox")
finally:
    if session is not None:
        try:
            session.delete_session()
        except Exception:
            pass
    browser.terminate()
    try:
        browser.wait(10)
    except subprocess.TimeoutExpired:
        browser.kill()
    shutil.rmtree(profile, ignore_errors=True)
