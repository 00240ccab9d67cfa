"""What both browser checks share."""
import time


def wait_for(what, test, timeout=30):
    """Polls `test` until it returns something true (returned), or exits
    with a message after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = test()
        if value:
            return value
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")
