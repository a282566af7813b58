"""The browser modules share test_console's stack (the console served by the gateway), browser
and watched page; each module still starts its own stack (the fixture is module-scoped)."""

from tests.browser.test_console import browser, stack, watched

__all__ = ["browser", "stack", "watched"]
