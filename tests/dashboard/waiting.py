"""What both browser checks share."""
import time


def wait_for(what, test, timeout=30):
    """Polls `test` until it returns something true (returned), or exits
    with a message after `timeout` seconds. An element that went stale
    while `test` looked at it (the page redraws its tables every second)
    counts as not yet: the next poll finds the new one."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = test()
        except Exception as e:  # Selenium's and Marionette's stale-element errors
            if "Stale" not in type(e).__name__:
                raise
            value = None
        if value:
            return value
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")
