#!/usr/bin/env python3
"""The chat page of `turbospark serve`, driven in headless Chromium (Debian's chromium and
chromium-driver, selenium from PyPI): a scripted conversation against the default model.

Run by ctest (ServePage, label cli); by hand:
    TS_BIN=build/turbospark TS_DEFAULT_GGUF=~/.local/share/turbospark/default-model.gguf \\
        python3 tests/server/test_page.py -v
The screenshot lands in $TS_PAGE_SHOT (default: a temporary folder), named chat-page.png.
"""
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import unittest
import urllib.request

BIN = os.environ.get("TS_BIN", "build/turbospark")
MODEL = os.environ.get("TS_DEFAULT_GGUF", "")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_serve import start_server  # noqa: E402  (the same server start as the API tests)

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # reported by the skip below
    webdriver = None


def metric(base, name):
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    return float(re.search(rf"(?m)^turbospark_{name} (\S+)$", text).group(1))


HAVE_BROWSER = webdriver is not None and os.path.exists(CHROMIUM) and os.path.exists(DRIVER)
# ctest sets TS_PAGE_REQUIRED: there a missing browser fails the test instead of skipping it.
REQUIRED = os.environ.get("TS_PAGE_REQUIRED", "") not in ("", "0")


@unittest.skipUnless(MODEL and os.path.exists(MODEL), "TS_DEFAULT_GGUF not set")
@unittest.skipUnless(HAVE_BROWSER or REQUIRED, "needs chromium, chromium-driver (apt) and selenium (pip)")
class ChatPage(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not HAVE_BROWSER:
            raise RuntimeError("the page test needs chromium and chromium-driver (apt) and selenium (pip): "
                               "scripts/setup.sh installs them")
        cls.proc, cls.base = start_server(model=MODEL, ctx=2048)
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1000,800"):
            opts.add_argument(a)
        cls.driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
        cls.driver.set_page_load_timeout(60)
        cls.shots = os.environ.get("TS_PAGE_SHOT") or tempfile.mkdtemp()

    @classmethod
    def tearDownClass(cls):
        cls.driver.quit()
        cls.proc.send_signal(signal.SIGTERM)
        cls.proc.wait(timeout=15)

    def open_page(self, temperature="0"):
        d = self.driver
        d.get(self.base + "/")
        WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "model").text != "")
        t = d.find_element(By.ID, "temp")
        t.clear()
        t.send_keys(temperature)
        return d

    def say(self, d, text):
        box = d.find_element(By.ID, "in")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)

    def wait_reply_done(self, d, n_assistant, timeout=300):
        WebDriverWait(d, timeout).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) >= n_assistant
            and d.find_element(By.ID, "send").is_enabled())
        return d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[n_assistant - 1].text

    def test_a_scripted_conversation_streams_keeps_context_and_stops(self):
        d = self.open_page()
        self.assertEqual(d.find_element(By.ID, "model").text,
                         json.loads(urllib.request.urlopen(self.base + "/v1/models").read())["data"][0]["id"])
        # A reply streams in, greedy: the answer the CLI gives.
        self.say(d, "What is the capital of France?")
        first = self.wait_reply_done(d, 1)
        self.assertIn("Paris", first)
        # The conversation is kept: the second request carries the first exchange.
        self.say(d, "And of Italy? Answer in one word.")
        second = self.wait_reply_done(d, 2)
        self.assertIn("Rome", second)
        msgs = d.execute_script("return messages")
        self.assertEqual([m["role"] for m in msgs], ["user", "assistant", "user", "assistant"])
        self.assertEqual(msgs[1]["content"].strip(), first.strip())
        d.save_screenshot(os.path.join(self.shots, "chat-page.png"))
        self.assertGreater(os.path.getsize(os.path.join(self.shots, "chat-page.png")), 10_000)
        # Stop: a long reply, stopped once it has started, stops growing; the server cancels it.
        cancelled = metric(self.base, "requests_cancelled_total")
        self.say(d, "Count from 1 to 1000, one number per line.")
        WebDriverWait(d, 120).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) >= 3
                                    and len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[2].text) > 5)
        d.find_element(By.ID, "stop").click()
        WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "send").is_enabled())
        stopped = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[2].text
        time.sleep(2)
        self.assertEqual(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[2].text, stopped)
        deadline = time.time() + 30
        while time.time() < deadline and metric(self.base, "requests_cancelled_total") <= cancelled:
            time.sleep(0.3)
        self.assertGreater(metric(self.base, "requests_cancelled_total"), cancelled)
        self.assertEqual(metric(self.base, "requests_running"), 0)

    def test_markdown_is_rendered_and_html_is_not(self):
        d = self.open_page()
        html = d.execute_script("return md(arguments[0])", "**bold** and `code`\n\n```py\n<b>x</b> = 1\n```")
        self.assertIn("<b>bold</b>", html)
        self.assertIn("<code>code</code>", html)
        self.assertIn("<pre><code>&lt;b&gt;x&lt;/b&gt; = 1\n</code></pre>", html)
        # What a user types is shown as text, never run as HTML.
        self.say(d, "<img src=x onerror=\"document.title='pwned'\"> hello")
        WebDriverWait(d, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.user")) >= 1)
        user = d.find_elements(By.CSS_SELECTOR, ".msg.user")[0]
        self.assertIn("<img src=x", user.text)
        self.assertEqual(d.find_elements(By.CSS_SELECTOR, ".msg img"), [])
        self.wait_reply_done(d, 1)
        self.assertNotEqual(d.title, "pwned")
        # Clear empties the conversation.
        d.find_element(By.ID, "clear").click()
        self.assertEqual(d.execute_script("return messages.length"), 0)
        self.assertEqual(d.find_elements(By.CSS_SELECTOR, ".msg"), [])


if __name__ == "__main__":
    unittest.main()
