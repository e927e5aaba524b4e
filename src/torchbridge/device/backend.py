"""Placeholder until the backend lands: registration is a no-op."""


def register(name: str) -> None:
    return None
