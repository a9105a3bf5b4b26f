"""Task modules `tests.app` does not import itself: its workers find them by autodiscovery (FANIN_TEST_AUTODISCOVER)."""
