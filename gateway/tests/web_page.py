"""Drives the web page in headless Chromium (Debian's chromium and chromium-driver, through
selenium; run by web_page.rs).

Usage: web_page.py URL SCREENSHOT [KEY] (WEB_QUESTION and WEB_MAX_TOKENS change the question
and the answer length, e.g. for the README's screenshot on the default models). Asks a question with "compare" on, waits for both
streamed answers and their sources, and saves a screenshot. With KEY the server needs one: the
page must ask for it after the first 401, then answer once it is entered.
"""
import os
import re
import sys

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

url, shot = sys.argv[1], sys.argv[2]
key = sys.argv[3] if len(sys.argv) > 3 else None

opts = webdriver.ChromeOptions()
opts.binary_location = "/usr/bin/chromium"
for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
    opts.add_argument(a)
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
try:
    driver.get(url)
    wait = WebDriverWait(driver, 120)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))
    status = lambda d: d.find_element(By.ID, "status").text
    driver.find_element(By.ID, "question").send_keys(
        os.environ.get("WEB_QUESTION", "What does specrag store for each chunk?")
    )
    driver.find_element(By.ID, "max_tokens").clear()
    driver.find_element(By.ID, "max_tokens").send_keys(os.environ.get("WEB_MAX_TOKENS", "12"))
    if key:
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: "API key" in status(d))
        assert driver.find_element(By.ID, "keybox").is_displayed()
        driver.find_element(By.ID, "key").send_keys(key)
        print("asked for a key")
    driver.find_element(By.ID, "compare").click()
    driver.find_element(By.ID, "go").click()
    wait.until(lambda d: status(d) == "done" or d.find_element(By.ID, "status").get_attribute("class") == "error")
    assert status(driver) == "done", status(driver)
    panes = driver.find_elements(By.CSS_SELECTOR, ".pane")
    assert len(panes) == 2, len(panes)
    driver.save_screenshot(shot)
    for p in panes:
        # Tiny random models may answer whitespace: count the tokens the stats report.
        stats = p.find_element(By.CSS_SELECTOR, ".stats").text
        tokens = re.search(r"(\d+) tokens, ", stats)
        assert tokens and int(tokens.group(1)) > 0, stats
        assert p.find_elements(By.CSS_SELECTOR, ".sources li"), "no sources"
        # queued, retrieve, KV load, speculate, align, prefill
        assert len(p.find_elements(By.CSS_SELECTOR, ".bar div")) == 6, "no TTFT bar"
        assert "TTFT" in p.find_element(By.CSS_SELECTOR, "h2 small").text
    verdict = driver.find_element(By.ID, "verdict").text
    assert "TTFT" in verdict, verdict
    print("verdict:", verdict)
    print("ok")
finally:
    driver.quit()
