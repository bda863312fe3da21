"""Placeholder replaced below."""


def available() -> bool:
    return False
