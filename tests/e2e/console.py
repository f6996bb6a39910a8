"""The approvals console (/ui) in a real browser: headless Chromium driven by Selenium.

Started by tests/e2e/console.rs with one JSON argument (the console's URL, the tokens,
where to save the screenshot). It signs in, watches pending approvals arrive live,
approves and denies with reasons, checks that markup and script in arguments render as
text and run nothing, and that an agent-only token and a requester under
distinct_approver cannot decide. It prints one JSON object (the approvals it decided or
left pending) for the Rust side to check through the API.
"""

import json
import sys
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    NoSuchElementException,
    TimeoutException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CFG = json.loads(sys.argv[1])
URL = CFG["url"]
WAIT = 30
IMG = "<img src=x onerror=alert(1)>"
SCRIPT = "</script><script>alert(2)</script>"


def api(token, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(URL + path, data=data, method=method)
    request.add_header("Authorization", "Bearer " + token)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def propose(token, session, tool, arguments):
    body = {
        "session_id": session,
        "wait_ms": 0,
        "tool_uses": [{"type": "tool_use", "id": "t1", "name": tool, "input": arguments}],
    }
    call = api(token, "POST", "/v1/tool_calls", body)["calls"][0]
    assert call["status"] == "pending_approval", call
    return {"approval_id": call["approval_id"], "call_id": call["call_id"]}


def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CFG["chromium"]
    options.add_argument("--headless=new")
    # The tests run as root (CI does), and Chromium refuses to run as root with its
    # own sandbox; the page it loads is the console under test on loopback.
    options.add_argument("--no-sandbox")
    options.add_argument("--disable-dev-shm-usage")
    options.add_argument("--window-size=1280,1500")
    # The system chromedriver, named explicitly: nothing is downloaded.
    return webdriver.Chrome(service=Service(CFG["chromedriver"]), options=options)


def wait(driver, predicate, what):
    try:
        return WebDriverWait(
            driver,
            WAIT,
            ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
        ).until(lambda d: predicate(d))
    except TimeoutException:
        # The page as it was, to say why.
        raise AssertionError(
            "timed out waiting for %s; at %s:\n%s"
            % (what, driver.current_url, driver.page_source[:6000])
        ) from None


def sign_in(driver, token, name):
    driver.get(URL + "/ui")
    field = driver.find_element(By.NAME, "token")
    assert field.get_attribute("type") == "password"
    field.send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#signin button[type=submit]").click()
    wait(
        driver,
        lambda d: name in d.find_element(By.ID, "signed-in-as").text,
        "the console signed in as " + name,
    )
    # The URL never holds the token.
    assert token not in driver.current_url, driver.current_url


def sign_out(driver):
    driver.find_element(By.CSS_SELECTOR, "header .who button[type=submit]").click()
    wait(driver, lambda d: d.find_element(By.NAME, "token"), "the sign-in page")


def item(driver, approval_id):
    return driver.find_element(By.CSS_SELECTOR, '[data-approval-id="%s"]' % approval_id)


def arrives_live(driver, approval_id):
    """Waits for an approval proposed after the page loaded to appear without a reload."""
    wait(driver, lambda d: item(d, approval_id), "approval %s to appear live" % approval_id)
    assert driver.execute_script("return window.__notReloaded === true"), "the page reloaded"
    return item(driver, approval_id)


def mark_page(driver):
    driver.execute_script("window.__notReloaded = true")


def no_dialog(driver):
    try:
        alert = driver.switch_to.alert
        text = alert.text
        alert.dismiss()
        raise AssertionError("a dialog opened: %r" % text)
    except NoAlertPresentException:
        pass


def only_our_script(driver):
    sources = driver.execute_script("return Array.from(document.scripts).map(s => s.src)")
    assert sources == [URL + "/ui/static/console.js"], sources
    images = driver.execute_script("return document.querySelectorAll('img').length")
    assert images == 0, "an <img> element was injected: %d" % images
    injected = driver.execute_script(
        "return document.querySelectorAll('[onerror], iframe, object, embed').length"
    )
    assert injected == 0, "an element from the arguments was injected: %d" % injected


def main():
    tokens = CFG["tokens"]
    driver = browser()
    out = {}
    try:
        # --- an approver signs in; a write_file arrives live with its diff ---------
        sign_in(driver, tokens["bob"], "bob")
        mark_page(driver)
        write = propose(
            tokens["alice"],
            "s1",
            "write_file",
            {"path": "notes.txt", "content": "line one\nline 2 changed\nline three\n"},
        )
        element = arrives_live(driver, write["approval_id"])
        assert element.find_element(By.CSS_SELECTOR, "dd.principal").text == "alice"
        assert element.find_element(By.CSS_SELECTOR, "dd.session").text == "s1"
        diff = element.find_element(By.CSS_SELECTOR, "pre.diff").text
        lines = [line.rstrip() for line in diff.splitlines()]
        for line in ("--- a/notes.txt", "+++ b/notes.txt", "-line two", "+line 2 changed"):
            assert line in lines, (line, diff)
        assert any(line.strip() == "line one" for line in lines), diff
        arguments = json.loads(element.find_element(By.CSS_SELECTOR, "pre.args").text)
        assert arguments["path"] == "notes.txt", arguments
        assert "expired" not in element.find_element(By.CSS_SELECTOR, "[data-expiry]").text
        assert element.find_element(By.CSS_SELECTOR, '[data-action="approve"]').is_enabled()
        assert element.find_element(By.CSS_SELECTOR, '[data-action="deny"]').is_enabled()
        driver.save_screenshot(CFG["screenshot"])

        # --- approve with a reason; the call completes -------------------------------
        element.find_element(By.NAME, "reason").send_keys("looks right")
        element.find_element(By.CSS_SELECTOR, '[data-action="approve"]').click()
        wait(driver, lambda d: "approved" in d.find_element(By.ID, "decided").text, "the decision")
        assert not driver.find_elements(
            By.CSS_SELECTOR, '[data-approval-id="%s"]' % write["approval_id"]
        ), "the approved call is still listed as pending"
        driver.find_element(By.LINK_TEXT, "Follow the call").click()
        wait(
            driver,
            lambda d: d.find_element(By.ID, "call-status").text == "ok",
            "the approved call to complete",
        )
        result = driver.find_element(By.ID, "call-result").text
        assert "notes.txt" in result, result
        out["approved"] = write

        # --- deny with a reason ------------------------------------------------------
        driver.get(URL + "/ui")
        mark_page(driver)
        denied = propose(
            tokens["alice"], "s1", "write_file", {"path": "other.txt", "content": "no\n"}
        )
        element = arrives_live(driver, denied["approval_id"])
        assert "a new file" in element.find_element(By.CSS_SELECTOR, "section.preview h3").text
        element.find_element(By.NAME, "reason").send_keys("not this file")
        element.find_element(By.CSS_SELECTOR, '[data-action="deny"]').click()
        wait(driver, lambda d: "denied" in d.find_element(By.ID, "decided").text, "the denial")
        out["denied"] = denied

        # --- markup and script in arguments render as text and run nothing ----------
        mark_page(driver)
        shell = propose(
            tokens["alice"],
            "s1",
            "execute_shell",
            {"command": "echo '%s' '%s'" % (IMG, SCRIPT)},
        )
        page = propose(
            tokens["alice"],
            "s1",
            "write_file",
            {"path": "x.html", "content": IMG + "\n" + SCRIPT + "\n"},
        )
        for shown in (shell, page):
            arrives_live(driver, shown["approval_id"])
        no_dialog(driver)
        only_our_script(driver)
        command = item(driver, shell["approval_id"]).find_element(By.CSS_SELECTOR, "pre.command").text
        assert command == "echo '%s' '%s'" % (IMG, SCRIPT), command
        diff = item(driver, page["approval_id"]).find_element(By.CSS_SELECTOR, "pre.diff").text
        assert "+" + IMG in diff.splitlines() and "+" + SCRIPT in diff.splitlines(), diff
        # And as the server renders it on a fresh load.
        driver.get(URL + "/ui")
        wait(driver, lambda d: item(d, page["approval_id"]), "the page with the approvals")
        no_dialog(driver)
        only_our_script(driver)
        body = driver.find_element(By.TAG_NAME, "body").text
        assert IMG in body and SCRIPT in body, "the literal text is not shown"
        out["xss"] = [shell, page]

        # --- an agent-only token sees the buttons disabled, and forcing one fails ----
        sign_out(driver)
        sign_in(driver, tokens["alice"], "alice")
        element = item(driver, shell["approval_id"])
        approve = element.find_element(By.CSS_SELECTOR, '[data-action="approve"]')
        deny = element.find_element(By.CSS_SELECTOR, '[data-action="deny"]')
        assert not approve.is_enabled() and not deny.is_enabled()
        explanation = element.find_element(By.CSS_SELECTOR, "[data-blocked]").text
        assert "approver role" in explanation, explanation
        driver.execute_script("arguments[0].disabled = false; arguments[0].click();", approve)
        wait(
            driver,
            lambda d: "approver role" in d.find_element(By.ID, "refusal").text,
            "the refusal of a forced approve",
        )
        out["forced"] = shell

        # --- distinct_approver: a requester cannot decide their own call -------------
        sign_out(driver)
        own = propose(tokens["carol"], "c1", "write_file", {"path": "mine.txt", "content": "x\n"})
        sign_in(driver, tokens["carol"], "carol")
        element = item(driver, own["approval_id"])
        assert not element.find_element(By.CSS_SELECTOR, '[data-action="approve"]').is_enabled()
        explanation = element.find_element(By.CSS_SELECTOR, "[data-blocked]").text
        assert "distinct_approver" in explanation, explanation
        # Someone else's call: carol may decide it.
        other = item(driver, page["approval_id"])
        assert other.find_element(By.CSS_SELECTOR, '[data-action="approve"]').is_enabled()
        out["own"] = own
    finally:
        driver.quit()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
